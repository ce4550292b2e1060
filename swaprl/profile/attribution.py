"""Who holds the device memory at a phase boundary: the whole-device figure split into named categories.

    from swaprl.profile.attribution import attribute
    attribute(runtime.status())["categories"]   # {"params": ..., "optimizer": ..., "unattributed": ...}

The categories always sum to the whole-device figure (NVML, or the CUDA driver without NVML) exactly: what no
category explains is "unattributed", and it is shown even when negative (some figure overcounts), never clipped. A
large |unattributed| is the finding: another process on the GPU, memory allocated outside torch and the engine, or
an engine reporting what it does not hold.

    params, grads, optimizer   trainer tensors on the device now (runtime.status())
    engine_weights, kv_cache   the engine's own accounting (vLLM's sleep-mode pool)
    engine_other               the rest of the engine's memory (CUDA graphs, workspaces), or all of it when the
                               engine reports no breakdown
    activations                torch's default memory pool less the trainer tensors above: activations, temporaries
                               and the caching allocator's free blocks; plus what the trainer's pausable regions
                               (`Runtime.pausable`: a captured step's graph pool) hold now
    cuda_context               the driver's reservation (NVML v2 `reserved`) plus this process's memory (NVML
                               per-process figure) outside torch's default pool and the
                               engine: the CUDA context, loaded kernels, libraries allocating outside torch; 0 when
                               the per-process figure is unavailable (it then stays inside unattributed)
    unattributed               device used minus all of the above: other processes, driver reservations, errors

Private torch memory pools (vLLM's `MemPool`, CUDA-graph pools) are left out of "activations": their bytes are the
engine's and keep their address range even while the engine sleeps, when torch still counts them as reserved.
"""

from __future__ import annotations

from ..config import MEMORY_CATEGORIES as CATEGORIES

TRAINER: tuple[str, ...] = ("params", "grads", "optimizer")


def attribute(status: dict, *, source: str = "nvml", private_pool_bytes: int = 0,
              process_used_bytes: int | None = None, driver_reserved_bytes: int = 0) -> dict:
    """Split the device memory described by `status` (a `Runtime.status()` dict) into `CATEGORIES`.

    `source`: where `status["device_memory"]["used"]` came from ("nvml" or "cuda_driver"). `private_pool_bytes`:
    bytes torch reserves in private pools (see module docstring). `process_used_bytes`: NVML's figure for this
    process, which measures `cuda_context`. Returns {"total", "source", "categories", "notes"} (and on CUDA
    "torch_private_pools"); on a device without a memory figure (CPU) "source" is "runtime" and "total" is the sum
    of the runtime's own figures.
    """
    cats = dict.fromkeys(CATEGORIES, 0)
    for name in TRAINER:
        cats[name] = int(status.get(name, {}).get("bytes", 0))
    engine = status.get("engine") or {}
    engine_total = int(engine.get("bytes", 0))
    parts = [engine.get(k) for k in ("weights_bytes", "kv_cache_bytes", "other_bytes")]
    if all(p is None for p in parts):
        cats["engine_other"] = engine_total
    else:
        weights, kv, other = (int(p or 0) for p in parts)
        cats["engine_weights"], cats["kv_cache"] = weights, kv
        cats["engine_other"] = other + max(0, engine_total - weights - kv - other)
    engine_sum = cats["engine_weights"] + cats["kv_cache"] + cats["engine_other"]
    notes: list[str] = []

    device_memory = status.get("device_memory")
    if device_memory is None:
        notes.append(f"no device memory figure on {status.get('device', 'this device')}: only the runtime's own "
                     "tensors and the engine's figures are attributed; activations and unattributed are not "
                     "measured")
        return {"total": sum(cats.values()), "source": "runtime", "categories": cats, "notes": notes}

    used = int(device_memory["used"])
    default_pool = int(device_memory.get("torch_reserved", 0)) - int(private_pool_bytes)
    regions = sum(int(r.get("bytes", 0)) for r in (status.get("regions") or {}).values())
    cats["activations"] = default_pool - sum(cats[k] for k in TRAINER) + regions
    if process_used_bytes is None:
        notes.append("cuda_context not measured (no NVML per-process figure): it is inside unattributed")
    else:
        # The driver's own reservation (about 0.5 GiB on an H100) is in NVML's device figure but in no process's.
        cats["cuda_context"] = (int(process_used_bytes) - default_pool - regions - engine_sum
                                + int(driver_reserved_bytes))
    cats["unattributed"] = used - sum(v for k, v in cats.items() if k != "unattributed")
    return {"total": used, "source": source, "categories": cats, "notes": notes,
            "torch_private_pools": int(private_pool_bytes)}
