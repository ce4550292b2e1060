"""Weight sync names (swaprl/sync.py): the checkpoint names a wrapped trainer's parameters are sent under."""

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from swaprl.sync import check_names, hf_name, trainer_weights


@pytest.mark.parametrize(("wrapped", "name"), [
    ("module.model.embed_tokens.weight", "model.embed_tokens.weight"),  # DDP
    ("_orig_mod.lm_head.weight", "lm_head.weight"),  # torch.compile
    ("module._orig_mod.model.norm.weight", "model.norm.weight"),  # DDP around a compiled model
    ("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.mlp.up_proj.weight",
     "model.layers.0.mlp.up_proj.weight"),  # FSDP1, root and per-layer wrapping
    ("model.layers.3._checkpoint_wrapped_module.self_attn.q_proj.weight",
     "model.layers.3.self_attn.q_proj.weight"),  # activation checkpointing of a layer
    ("model.norm.weight", "model.norm.weight"),
])
def test_hf_name_drops_wrapper_components(wrapped, name):
    assert hf_name(wrapped) == name


@pytest.mark.parametrize("name", [
    "visual.submodule.weight",
    "encoder.module.weight",  # a model's own submodule named "module": only DDP's leading one is a wrapper
    "my_module.weight",
    "encoder.x_orig_mod.bias",
    "model.submodule.layers.0.mlp.weight",
    "not_fsdp_wrapped_module.weight",
])
def test_hf_name_keeps_names_that_only_contain_a_wrapper_name(name):
    assert hf_name(name) == name


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.submodule = torch.nn.Linear(4, 4)
        self.my_module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


# torch.compile imports inductor, whose import of torch.utils.mkldnn warns about torch.jit; nothing of swaprl's.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_trainer_weights_of_wrapped_model_match_the_bare_model():
    net = _Net()
    bare = {n: tuple(p.shape) for n, p in net.named_parameters()}
    assert sorted(bare) == ["my_module.0.bias", "my_module.0.weight", "my_module.1.bias", "my_module.1.weight",
                            "submodule.bias", "submodule.weight"]
    net.my_module = checkpoint_wrapper(net.my_module)
    compiled = torch.compile(net)  # names gain "_orig_mod."; nothing is compiled before a forward
    assert any("_checkpoint_wrapped_module" in n for n, _ in compiled.named_parameters())
    assert {n: tuple(p.shape) for n, p in trainer_weights(compiled).items()} == bare
    check_names(compiled, {n: (shape, torch.float32) for n, shape in bare.items()})


def _layered_model():
    """A decoder's names: an embedding larger than the bucket, two layers of two tensors each, a norm, a head."""
    from swaprl.checkpoints import random_model

    torch.manual_seed(0)
    return random_model("tiny", layers=2, device="cpu")


def test_the_largest_bucket_is_what_the_sync_holds_at_once_embedding_included():
    from swaprl.sync import buckets, largest_bucket_bytes

    model = _layered_model()
    embed = model.get_input_embeddings().weight
    bf16 = {n: torch.bfloat16 for n in trainer_weights(model)}
    for bucket_bytes, dtypes in ((1, None), (1, bf16), (embed.numel() * 4 + 1, None), (10 * 2**30, bf16)):
        built = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets(model, bucket_bytes, dtypes)]
        assert largest_bucket_bytes(model, bucket_bytes, dtypes) == max(built)
    # One byte per bucket: every layer, and every tensor outside the layers, is a bucket of its own.
    layer = sum(p.numel() * 2 for n, p in trainer_weights(model).items() if n.startswith("model.layers.0."))
    assert largest_bucket_bytes(model, 1, bf16) == max(layer, embed.numel() * 2) > 1
    assert largest_bucket_bytes(model, 10 * 2**30, bf16) == sum(p.numel() * 2 for p in trainer_weights(model).values())


def test_the_sync_lets_each_bucket_go_before_it_gathers_the_next(monkeypatch):
    """No tensor of a bucket the engine has loaded is alive while the next bucket is gathered (cast to the engine's
    dtype here, so each bucket's tensors are the sync's own, as an FSDP2 gather's are)."""
    import gc
    import weakref

    from swaprl import sync

    model = _layered_model()
    loaded: list[weakref.ref] = []
    alive_while_gathering = []

    def gather(t):
        gc.collect()
        alive_while_gathering.append(sum(ref() is not None for ref in loaded))
        return t

    class Engine:
        def expected_weights(self):
            return {n: (tuple(p.shape), torch.bfloat16) for n, p in trainer_weights(model).items()}

        def load_weights(self, bucket):
            loaded.extend(weakref.ref(t) for _, t in bucket)

    monkeypatch.setattr(sync, "_full", gather)
    sent = sync.push_weights(model, Engine(), bucket_bytes=1)
    assert len(loaded) == len(trainer_weights(model)) == len(alive_while_gathering)
    assert alive_while_gathering == [0] * len(loaded)
    assert sent == sum(p.numel() * 2 for p in trainer_weights(model).values())
