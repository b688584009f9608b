"""`build_part`: a part of a model built alone has the values the whole build gives it.

The reference is a plain ``model_fn()`` from the same seed: every kept parameter must equal its
counterpart bit for bit, every other parameter must be on the meta device (never held), and the
random generator must stand where the whole build leaves it (what the model draws next, dropout
included, is the same). Where the partial build cannot mirror the whole one faithfully, it must
fall back to the whole model - never a model with other values.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from partrain.launch import launch
from partrain.nn.partial import build_part, build_shards, chunk_rows, move_model
from partrain.strategies.pipeline import Pipeline


def sequential() -> nn.Module:
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(24, 24), nn.ReLU())], nn.Linear(24, 10))


class Reinitialised(nn.Module):
    """Initialisation the way transformers write it: modules draw in their constructors, then the
    root draws again over all of them (``apply``), a weight is tied, a parameter is initialised
    by ``orthogonal_`` (which skips meta tensors: stand-ins must not look like meta), a parameter
    is replaced after registration, and a buffer is computed from a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 12)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(12, 12), nn.LayerNorm(12)) for _ in range(3))
        self.head = nn.Linear(12, 40, bias=False)
        self.head.weight = self.embed.weight
        self.mix = nn.Parameter(torch.empty(12, 12))
        nn.init.orthogonal_(self.mix)
        self.gate = nn.Parameter(torch.empty(5))
        self.gate = nn.Parameter(torch.rand(12))  # the first one is dropped
        self.register_buffer("scale", self.mix.detach().abs().sum(0))
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.uniform_(module.bias, -0.1, 0.1)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)


def names_starting(*prefixes: str) -> Callable[[nn.Module], set[str]]:
    return lambda skeleton: {n for n, _ in skeleton.named_parameters(remove_duplicate=False)
                             if n.startswith(prefixes)}


def check_against_whole(model_fn: Callable[[], nn.Module], keep: Callable[[nn.Module], set[str]],
                        partial_expected: bool) -> nn.Module:
    torch.manual_seed(7)
    whole = model_fn()
    after_whole = torch.rand(8)
    torch.manual_seed(7)
    model, partial = build_part(model_fn, keep)
    after = torch.rand(8)
    assert partial is partial_expected
    assert torch.equal(after, after_whole)  # the generator stands where the whole build left it
    reference = dict(whole.named_parameters(remove_duplicate=False))
    params = dict(model.named_parameters(remove_duplicate=False))
    assert params.keys() == reference.keys()
    kept = keep(model)
    held = {id(p) for n, p in params.items() if n in kept}  # a tied weight is kept under any of its names
    for name, value in params.items():
        if partial and id(value) not in held:
            assert value.is_meta and type(value) is nn.Parameter, name
        else:
            assert not value.is_meta and torch.equal(value, reference[name]), name
    return model


@pytest.mark.parametrize("children", [("0", "2"), ("4", "6", "8"), ("2",)])
def test_a_sequentials_part_has_the_whole_builds_values(children):
    check_against_whole(sequential, lambda sk: {n for n, _ in sk.named_parameters() if n.split(".")[0] in children},
                        partial_expected=True)


@pytest.mark.parametrize("kept", [("blocks.2", "head"), ("blocks.0", "mix"), ("gate",)])
def test_re_initialised_tied_and_replaced_parameters_keep_the_whole_builds_values(kept):
    model = check_against_whole(Reinitialised, names_starting(*kept), partial_expected=True)
    assert model.head.weight is model.embed.weight  # the tie survives, real or meta
    # a buffer computed from a left-out weight is meta too; from a kept one, the whole build's
    torch.manual_seed(7)
    assert model.scale.is_meta if model.mix.is_meta else torch.equal(model.scale, Reinitialised().scale)


def test_data_dependent_initialisation_builds_the_whole_model():
    """trunc_normal_ draws again until its values fall in range: how much it draws depends on the
    values, which a left-out parameter does not have. The whole model, with its values."""

    def truncated() -> nn.Module:
        model = sequential()
        for m in model:
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=1.0, a=-0.5, b=0.5)
        return model

    check_against_whole(truncated, lambda sk: {"0.weight", "0.bias"}, partial_expected=False)


def test_a_kept_parameter_computed_from_a_left_out_one_builds_the_whole_model():
    class Derived(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 6)
            self.b = nn.Linear(6, 6)
            with torch.no_grad():
                self.b.weight.copy_(self.a.weight * 2)

    check_against_whole(Derived, names_starting("b."), partial_expected=False)


def test_models_it_cannot_follow_are_built_whole():
    """A model that does not build on meta (it reads a value while building), and a model that
    builds differently the second time, are built whole, from the caller's random state."""

    class ReadsAValue(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.n = int(self.a.weight.abs().sum() > 0) + 1
            self.b = nn.Linear(4, 4 * self.n)

    check_against_whole(ReadsAValue, names_starting("b."), partial_expected=False)
    calls = []

    def changing() -> nn.Module:
        calls.append(1)
        return nn.Sequential(*[nn.Linear(4, 4) for _ in range(len(calls) + 1)])

    torch.manual_seed(7)
    model, partial = build_part(changing, names_starting("0."))
    assert not partial and not any(p.is_meta for p in model.parameters())


def test_nothing_left_out_is_the_plain_build():
    model = check_against_whole(sequential, lambda sk: {n for n, _ in sk.named_parameters()}, partial_expected=False)
    assert not any(p.is_meta for p in model.parameters())


def test_move_model_leaves_meta_parameters_where_they_are():
    torch.manual_seed(0)
    model, partial = build_part(sequential, names_starting("0."))
    assert partial
    moved = move_model(model, torch.device("cpu"))
    assert moved[0].weight.device.type == "cpu" and moved[2].weight.is_meta


def built_stage(strategy: Pipeline) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    model = strategy.build_model(sequential)
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved1f1b"])
def test_each_pipeline_stage_builds_its_own_layers_with_the_whole_builds_values(schedule):
    """Two processes: each holds only the layers of its own stages (virtual stages: two chunks
    each, not next to each other); together they hold the whole model, with its values."""
    first, second = launch(built_stage, workers=2, strategy=Pipeline(schedule=schedule), threads=1, timeout=60)
    torch.manual_seed(3)
    whole = dict(sequential().named_parameters())
    assert first and second and not set(first) & set(second)
    assert set(first) | set(second) == set(whole)
    for name, value in {**first, **second}.items():
        assert torch.equal(value, whole[name]), name
    sizes = [sum(v.numel() for v in part.values()) for part in (first, second)]
    assert max(sizes) < 0.75 * sum(v.numel() for v in whole.values())  # about half each


# ----- build_shards: every parameter by rows, a worker's chunk (fsdp) ---------------------------
def hf_style() -> nn.Module:
    """Initialisation as Hugging Face writes it: through ``.data`` (a view of all of the parameter),
    a fill, an element-wise product, a copy from a whole tensor; and a model cast to float64."""
    model = nn.Sequential(nn.Embedding(9, 4), nn.Linear(4, 7), nn.LayerNorm(7), nn.Linear(7, 3))
    model[0].weight.data.normal_(mean=0.0, std=0.5)
    model[1].weight.data.uniform_(-1, 1).mul_(0.25)
    model[1].bias.data.fill_(0.1)
    with torch.no_grad():
        model[3].weight.copy_(torch.arange(21.0).view(3, 7))
    return model.double()


def tiny_gpt() -> nn.Module:
    from partrain.models import gpt

    return gpt(vocab_size=11, n_layer=2, n_head=2, n_embd=8, block_size=8)


@pytest.mark.parametrize("model_fn", [sequential, hf_style, tiny_gpt], ids=["sequential", "hf_style", "gpt"])
@pytest.mark.parametrize("world", [2, 3])
def test_each_workers_chunks_have_the_whole_builds_rows(model_fn, world):
    """Chunk r of every parameter is rows [r * ceil(n / world), ...) of the whole build's, bit for
    bit (3 workers: uneven chunks, and none for a bias of 2 rows); buffers are the whole
    build's; every parameter is meta; the generator stands where the whole build left it."""
    torch.manual_seed(7)
    whole = model_fn()
    after_whole = torch.rand(8)
    for rank in range(world):
        torch.manual_seed(7)
        built = build_shards(model_fn, rank, world)
        assert built is not None
        model, shards = built
        assert torch.equal(torch.rand(8), after_whole)
        reference = dict(whole.named_parameters(remove_duplicate=False))
        assert shards.keys() == reference.keys()
        for name, value in reference.items():
            rows = torch.chunk(value.detach(), world)
            expected = rows[rank] if rank < len(rows) else value.detach()[:0]
            assert shards[name].dtype == value.dtype and torch.equal(shards[name], expected), name
        assert all(p.is_meta and type(p) is nn.Parameter for p in model.parameters())
        for name, buffer in whole.named_buffers():
            assert torch.equal(dict(model.named_buffers())[name], buffer), name
    assert chunk_rows(9, 2, 3) == (6, 9) and chunk_rows(4, 2, 3) == (4, 4)  # torch.chunk: 2 + 2 rows, none


def test_what_a_chunk_cannot_follow_is_left_to_a_whole_build():
    """``orthogonal_`` copies a QR factor of the whole matrix in, a row written through a view of
    part of a parameter, a buffer computed from a weight, frozen elements: no chunks (the
    caller builds the model whole), and the random generator untouched."""

    def row_view() -> nn.Module:
        model = sequential()
        model[0].weight.data[0].zero_()
        return model

    def frozen() -> nn.Module:
        from partrain.nn import freeze, idx

        model = sequential()
        freeze(model[0].weight, idx[0])
        return model

    for model_fn in (Reinitialised, row_view, frozen):
        torch.manual_seed(7)
        state = torch.get_rng_state()
        assert build_shards(model_fn, 0, 2) is None, model_fn
        assert torch.equal(torch.get_rng_state(), state)
