"""What `attach` refuses, before any memory moves or any engine is built: each error says what to change."""

from __future__ import annotations

import torch

from .compat import torch as torch_compat
from .compat.torch import local_tensor
from .config import SwapConfig
from .memory import default_reserve_bytes, gib
from .distributed import is_fsdp2
from .engines.base import Engine
from .optimizer_hooks import masters_of
from .partitions import FlatPartitions


def check_trainer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: SwapConfig, *,
                  partitions: FlatPartitions | None = None) -> None:
    """Refuse a model, optimizer and config that swaprl cannot drive together. `partitions`: the flat partitions
    `optimizer` steps in place of the model's parameters, declared by their owner (`swaprl.partitions`)."""
    torch_compat.check_version()
    if not isinstance(config, SwapConfig):
        raise TypeError(f"config must be a swaprl.SwapConfig, not {type(config).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    mine = {id(p) for p in model.parameters()}
    masters = masters_of(optimizer)  # installed by an earlier attach: each stands for its model parameter
    if partitions is not None:
        _check_partitions(mine, partitions, config)
    declared = {id(t) for t in partitions.tensors} if partitions is not None else set()
    foreign = [(gi, pi, tuple(p.shape)) for gi, g in enumerate(optimizer.param_groups)
               for pi, p in enumerate(g["params"])
               if id(masters.model_param(p) if masters is not None and masters.is_master(p) else p) not in mine
               and id(p) not in declared]
    if foreign:
        listed = ", ".join(f"group {g} param {i} shape {s}" for g, i, s in foreign[:5])
        raise ValueError(f"{len(foreign)} optimizer parameter(s) are not parameters of the model ({listed}); build "
                         "the optimizer from this model's parameters, e.g. AdamW(model.parameters()), after any "
                         "wrapping or moving of the model")
    check_trainable(model, model_device(model))
    if (config.master_weights or masters is not None) and torch.is_inference_mode_enabled():
        # The masters attach makes (or places on the device) would be inference tensors: torch refuses any in-place
        # update of one outside inference mode, so the first optimizer step would fail.
        raise RuntimeError("swaprl.attach() with fp32 master weights inside torch.inference_mode(): the masters it "
                           "makes there would be inference tensors, which no optimizer step outside that block may "
                           "update; attach outside the inference_mode() block (inside torch.no_grad() is fine)")
    sparse = [f"{name}.weight" for name, m in model.named_modules()
              if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag) and m.sparse and m.weight.requires_grad]
    if sparse:
        # A sparse gradient (and the sparse momentum SGD makes of it) has no bytes of its own to move to a host
        # buffer and back, nor a layout a chunk of the streamed step can stage.
        raise ValueError(f"{', '.join(sparse[:5])} get sparse gradients (nn.Embedding(sparse=True)), which swaprl "
                         "cannot move between the device and host memory; build the embedding with sparse=False "
                         "(the same training, with a dense gradient), or freeze it (requires_grad_(False))")
    if config.params == "offload" and is_fsdp2(model):
        # FSDP2 all-gathers from a padded buffer of its own (FSDPParam._sharded_param_data) of which the parameter's
        # shard is a view: moving the shard would free nothing, and the optimizer would update a copy FSDP never
        # reads again.
        raise ValueError("SwapConfig(params='offload') with a model sharded by FSDP2 (fully_shard): its parameter "
                         "shards live in buffers FSDP2 owns, which swaprl cannot move. Use params='keep' (the "
                         "shards are 1/world of the model), or have FSDP2 keep them in host memory for good: "
                         "fully_shard(module, offload_policy=CPUOffloadPolicy())")
    if config.optimizer_states != "auto" and config.state_split()["host"] > 0 and \
            isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(f"SwapConfig(optimizer_states={config.optimizer_states!r}) with LBFGS: its state (the search "
                        "directions) spans all parameters together, so it cannot be stepped a chunk of parameters at "
                        "a time from host memory. Use optimizer_states='swap'")


def _check_partitions(model_params: set[int], partitions: FlatPartitions, config: SwapConfig) -> None:
    """An optimizer over declared flat partitions: the partitions are not the model's parameters, and swaprl's own
    ways of holding what their owner holds (fp32 masters, a streamed step, moving the parameters) are refused."""
    owner = partitions.owner
    if any(id(t) in model_params for t in partitions.tensors):
        raise ValueError(f"{owner}'s flat partitions include parameters of the model; declare only the flat tensors "
                         "the optimizer steps in place of the model's parameters")
    if config.master_weights:
        raise ValueError(f"SwapConfig(master_weights=True) with {owner}: its optimizer steps fp32 partitions "
                         f"{owner} keeps itself, its own master weights; leave master_weights=False")
    if config.optimizer_states != "auto" and config.state_split()["host"] > 0 and not partitions.streamable:
        raise ValueError(f"SwapConfig(optimizer_states={config.optimizer_states!r}) with {owner}: the 'host' home "
                         f"streams the states through the device inside optimizer.step(), which runs inside "
                         f"{owner}'s own step over its partitions, and {owner} does not declare that step streamable "
                         f"(FlatPartitions.models). Use 'swap' (or a split of 'device' and 'swap'), or have {owner} "
                         f"keep the states in host memory itself (its optimizer offload)")
    if config.params == "offload":
        raise ValueError(f"SwapConfig(params='offload') with {owner}: the model's parameters are views of (or "
                         f"placeholders for) flat buffers {owner} owns, which swaprl cannot move; use params='keep', "
                         f"or have {owner} keep the parameters in host memory itself (its parameter offload)")


def check_engine(engine: Engine, config: SwapConfig) -> None:
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a swaprl.Engine, not {type(engine).__name__}")
    if engine.shares_trainer_weights and config.params == "offload":
        raise ValueError(f"SwapConfig(params='offload') with {type(engine).__name__}, which generates with the "
                         "trainer's own parameters: they must stay on the device. Use params='keep', or an engine "
                         "with its own weights (vLLM).")


def model_device(model: torch.nn.Module) -> torch.device:
    """The one device the model's parameters (or their local shards) are on."""
    devices = {local_tensor(p).device for p in model.parameters()}
    if not devices:
        raise ValueError("the model has no parameters; attach the module you train")
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are spread over {sorted(map(str, devices))}; swaprl drives one "
                         "device per process: move the model to one device (or shard it with FSDP2)")
    return devices.pop()


def check_trainable(model: torch.nn.Module, device: torch.device) -> None:
    """Refuse, before anything moves, a trainer that cannot take a single step on its device whatever swaprl moves:
    its parameters and their gradients alone (both on the device while training, the gradients made by every
    backward) leave less than the reserve, even with every optimizer state in host memory."""
    if device.type != "cuda":
        return
    total = torch.cuda.mem_get_info(device)[1]
    params = sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in model.parameters())
    grads = sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in model.parameters()
                if p.requires_grad)
    reserve = default_reserve_bytes(total)
    if params + grads + reserve > total:
        raise ValueError(
            f"this trainer cannot train on {device} at all: its parameters ({gib(params):.2f} GiB) and their "
            f"gradients ({gib(grads):.2f} GiB) with the {gib(reserve):.2f} GiB reserve for activations need "
            f"{gib(params + grads + reserve):.2f} GiB of the device's {gib(total):.2f} GiB, before any optimizer "
            "state (which SwapConfig(optimizer_states='host') would keep in host memory). Shard the model over more "
            "GPUs (FSDP2's fully_shard) or train fewer parameters; `swaprl plan` gives the figures per GPU for a "
            "model and a cluster")
