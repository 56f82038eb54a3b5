"""The compiled core: same tokens as eager, and no recompilation in steady state."""
import pytest
import torch
from torch._dynamo.utils import counters

from dflash2 import kernels
from dflash2 import spec_decode as sd
from dflash2.target import Target, install_output_hooks
from targets import reference_greedy, tiny_drafter, tiny_target


@pytest.mark.slow
@pytest.mark.parametrize("backend,method", [("sdpa", "dflash2"), ("flex", "dflash2"), ("sdpa", "dflash2-tree")])
def test_compiled_equals_eager_and_never_recompiles(backend, method):
    """The chain, and the tree (its target forward takes slots and a tree mask: compiled per view bucket too)."""
    if backend not in kernels.attention_backends() or (backend == "flex" and not torch.cuda.is_available()):
        pytest.skip("flex inside the compiled drafter needs a GPU (CPU inductor cannot lower it, torch 2.13)")
    torch._dynamo.reset()
    counters.clear()  # dynamo's counters are process-wide; earlier compiled tests must not leak in
    model = tiny_target("llama")
    drafter = tiny_drafter(model, head_dim=16)  # CPU flex kernels need head_dim >= 16
    target = Target(model, drafter.config.target_layer_ids)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    kw = dict(method=method, tree_budget=8) if method == "dflash2-tree" else {}
    eager = [sd.generate(target, drafter, [p], max_new_tokens=512, **kw)[0].tokens for p in prompts]

    drafter.attn_backend = backend
    sd.compile_core(target, drafter)
    warm = sd.generate(target, drafter, [prompts[0]], max_new_tokens=512, static=True, **kw)[0]
    graphs = counters["stats"]["unique_graphs"]
    frames, recompiles = dict(counters["frames"]), dict(counters["recompiles"])
    steady = sd.generate(target, drafter, [prompts[1]], max_new_tokens=512, static=True, **kw)[0]
    assert warm.tokens == eager[0] and steady.tokens == eager[1]
    assert counters["stats"]["unique_graphs"] == graphs, "a 512-token generation recompiled after warm-up"
    assert dict(counters["frames"]) == frames
    # Warm-up compiles one graph per view bucket; after it, nothing recompiles or breaks.
    assert dict(counters["recompiles"]) == recompiles and not counters["graph_break"]
    assert graphs >= 2, "the warm-up should have met several view buckets"


def test_static_shapes_equal_dynamic_shapes_in_batches():
    """Static mode keeps finished rows frozen in place instead of dropping them; same outputs."""
    model = tiny_target("minimax_m3")
    drafter = tiny_drafter(model)
    target = Target(model, drafter.config.target_layer_ids)
    prompts = [[1, 2, 3], list(range(5, 20)), [7]]
    refs = [reference_greedy(model, p, 24) for p in prompts]
    stop = refs[0][5]  # one row stops early, so rows finish at different steps
    a = sd.generate(target, drafter, prompts, max_new_tokens=24, stop_ids=[stop])
    b = sd.generate(target, drafter, prompts, max_new_tokens=24, stop_ids=[stop], static=True)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.tokens for r in a] == [ref[: len(r.tokens)] for ref, r in zip(refs, a)]
    assert len({len(r.tokens) for r in a}) > 1


def test_backend_choice_per_device():
    assert kernels.default_backend("cpu") == "sdpa"
    assert "flash" not in kernels.attention_backends("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU backends run only where a GPU is present")
@pytest.mark.parametrize("backend", ["flex", "flash"])
def test_gpu_backends_equal_sdpa(backend):
    if backend not in kernels.attention_backends("cuda"):
        pytest.skip(f"{backend} is not available on this GPU")
    torch.manual_seed(0)
    b, h, kvh, T, S, d = 2, 8, 2, 8, 300, 64
    q = torch.randn(b, h, T, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, kvh, S, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q_pos = torch.tensor([[200 + i for i in range(T)], [100 + i for i in range(T)]], device="cuda")
    k_pos = torch.arange(S, device="cuda").expand(b, S)
    k_valid = k_pos < torch.tensor([[200], [100]], device="cuda")
    k_valid[:, -T:] = True
    ref = kernels.drafter_attention(q.float(), k.float(), v.float(), q_pos, k_pos, k_valid, 64, "sdpa")
    out = kernels.drafter_attention(q, k, v, q_pos, k_pos, k_valid, 64, backend)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.slow
@pytest.mark.skipif(not kernels.can_prepack(torch.zeros(1)), reason="this torch has no oneDNN")
def test_compiled_core_with_prepacked_linears():
    """The oneDNN linears are one custom op each inside the compiled graphs: no breaks, same tokens."""
    torch._dynamo.reset()
    counters.clear()
    model = tiny_target("llama")
    drafter = tiny_drafter(model, head_dim=16)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 3]]
    refs = [reference_greedy(model, p, 40) for p in prompts]  # before compiling: it would recompile per length
    assert kernels.prepack_linears(model) > 0 and kernels.prepack_linears(drafter) > 0
    target = Target(model, drafter.config.target_layer_ids)
    sd.compile_core(target, drafter)
    out = sd.generate(target, drafter, prompts[:2], max_new_tokens=40, static=True)
    assert [r.tokens for r in out] == refs[:2]
    # continuous batching: the third request is prefilled into a finished row of the compiled batch
    out = sd.generate(target, drafter, prompts, max_new_tokens=40, static=True, max_batch=2)
    assert [r.tokens for r in out] == refs
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"]


@pytest.mark.parametrize("arch", ["llama", "minimax_m3"])
def test_output_hooks_installed_before_compiling_capture_each_layer_once(arch):
    """compile_core installs transformers' hidden-state hooks eagerly; they must capture what a fresh model does."""
    import copy

    model = tiny_target(arch)
    fresh = copy.deepcopy(model)
    install_output_hooks(model)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        got = model(ids, output_hidden_states=True).hidden_states
        want = fresh(ids, output_hidden_states=True).hidden_states
    assert len(got) == len(want) == model.config.num_hidden_layers + 1
    assert all(torch.equal(a, b) for a, b in zip(got, want))
