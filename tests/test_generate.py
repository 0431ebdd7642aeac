"""Issue #7: LLM generation (StaticCache decode loop, dynamic cache) and input mutation."""
import re

import pytest
import torch
import transformers

import tpu_dynamo

from conftest import compile_tpu

TOKENS = 64


def tiny(kind: str, kv_heads: int = 2) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    common = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
    )
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=12, **common)).eval()
    if kind == "gemma2":
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(sliding_window=12, head_dim=16, **common)).eval()
    if kind == "gemma3":
        config = transformers.Gemma3TextConfig(
            sliding_window=12, head_dim=16, layer_types=["sliding_attention", "full_attention"], **common
        )
        return transformers.Gemma3ForCausalLM(config).eval()
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common)).eval()


def generate(model, ids, tokens, **kwargs):
    with torch.no_grad():
        return model.generate(
            ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0, **kwargs
        )


def generate_with_logits(model, ids, tokens, **kwargs):
    return generate(model, ids, tokens, output_logits=True, return_dict_in_generate=True, **kwargs)


def assert_same_generation(got, expected):
    """The same tokens, and every step's logits within 1e-5."""
    assert torch.equal(got.sequences, expected.sequences)
    for g, w in zip(got.logits, expected.logits):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


IDS = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_static_cache_generate_matches_eager_without_recompiles(kind):
    model = tiny(kind)
    expected = generate(model, IDS, TOKENS, cache_implementation="static")
    model.forward = compile_tpu(model.forward)
    got = generate(model, IDS, TOKENS, cache_implementation="static")
    assert torch.equal(got, expected)
    assert tpu_dynamo.stats()["compiles"] == 2  # prefill + one decode step graph for all 63 steps
    before = tpu_dynamo.stats()
    again = generate(model, IDS, TOKENS, cache_implementation="static")
    after = tpu_dynamo.stats()
    assert torch.equal(again, expected)
    assert after["compiles"] == before["compiles"]
    # The K/V caches stay on the device between steps: only the step's small inputs upload.
    steps = after["executions"] - before["executions"]
    assert (after["uploads"] - before["uploads"]) / steps < 4
    # ...and come back with no copy: each step's K and V (2 layers, and any other updated
    # input) are updated where the executable wrote them, which is where the host tensors live.
    assert after["updates_in_place"] - before["updates_in_place"] >= 4 * steps
    assert after["updates_copied"] == before["updates_copied"]


def test_dynamic_cache_generate_matches_eager():
    model = tiny("llama")
    expected = generate(model, IDS, 8)
    model.forward = compile_tpu(model.forward)  # dynamic=None: symbolic after the 2nd shape
    assert torch.equal(generate(model, IDS, 8), expected)


class Counter(torch.nn.Module):
    """Mutates a buffer and a plain tensor argument in place, like a StaticCache update."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(4))

    def forward(self, cache, pos, x):
        self.steps.add_(1)
        cache.index_copy_(0, pos, x)
        return cache.sum(0) + self.steps


def test_input_mutations_stay_on_device_and_host_sees_them():
    eager, compiled = Counter(), Counter()
    modules = []
    run = compile_tpu(compiled, options={"debug_callback": lambda d: modules.append(d["stablehlo"])})
    cache_e, cache_c = torch.zeros(8, 4), torch.zeros(8, 4)
    for step in range(6):
        if step == 4:  # a host-side change between calls must reach the device copy
            cache_e.fill_(2.0)
            cache_c.fill_(2.0)
        x = torch.full((1, 4), float(step + 1))
        pos = torch.tensor([step])
        want = eager(cache_e, pos, x)
        got = run(cache_c, pos, x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(cache_c, cache_e)
        torch.testing.assert_close(compiled.steps, eager.steps)
        if step == 2:
            uploads = tpu_dynamo.stats()["uploads"]
        if step == 3:  # steady state: only pos and x upload; cache and buffer stay resident
            assert tpu_dynamo.stats()["uploads"] - uploads == 2
    # Both mutated inputs are donated: XLA writes their new values into the input buffers, and
    # the host tensors live in those buffers (on the CPU plugin): nothing is copied back.
    assert [m.count("tf.aliasing_output") for m in modules] == [2]
    assert tpu_dynamo.stats()["updates_copied"] == 0


def test_inference_mode_updates_stay_in_place():
    """Inference tensors have no version counter, but a re-pointed one is found by its address."""
    eager, compiled = Counter(), Counter()
    run = compile_tpu(compiled)
    with torch.inference_mode():
        cache_e, cache_c = torch.zeros(8, 4), torch.zeros(8, 4)
        for step in range(5):
            if step == 3:  # a host-side change between calls reaches the next call
                cache_e[5] = 7.0
                cache_c[5] = 7.0
            x = torch.full((1, 4), float(step + 1))
            pos = torch.tensor([step])
            torch.testing.assert_close(run(cache_c, pos, x), eager(cache_e, pos, x))
            torch.testing.assert_close(cache_c, cache_e)
    stats = tpu_dynamo.stats()
    # Both updated inputs (the cache and the module's buffer) stay where the executable wrote
    # them; from the 2nd call on they are found by address.
    assert (stats["updates_copied"], stats["updates_in_place"], stats["view_hits"]) == (0, 10, 8)


def test_mutated_input_with_other_views_gets_a_copy():
    """A tensor whose storage something else also views keeps its storage (the view must see
    the update too), so its new value is copied back instead of re-pointing it."""
    eager, compiled = Counter(), Counter()
    run = compile_tpu(compiled)
    cache_e, cache_c = torch.zeros(8, 4), torch.zeros(8, 4)
    row_view = cache_c[2]
    for step in range(4):
        x = torch.full((1, 4), float(step + 1))
        pos = torch.tensor([step])
        torch.testing.assert_close(run(cache_c, pos, x), eager(cache_e, pos, x))
        torch.testing.assert_close(cache_c, cache_e)
    assert row_view.data_ptr() == cache_c.data_ptr() + 2 * 4 * 4
    torch.testing.assert_close(row_view, cache_e[2])
    assert tpu_dynamo.stats()["updates_copied"] >= 4


def test_symbolic_graph_specializes_per_shape_without_dynamo_recompiles():
    def f(x):
        b, s, h = x.shape
        pos = torch.arange(s, dtype=x.dtype)
        return (x.reshape(b, s * h).reshape(b, s, h) + pos[:, None]).softmax(-1).sum(1)

    torch._dynamo.utils.counters.clear()
    run = compile_tpu(f)
    lengths = [3, 5, 8, 13, 21]
    xs = [torch.randn(2, s, 4) for s in lengths]
    for x in xs:
        torch._dynamo.mark_dynamic(x, 1)
    for _ in range(2):
        for x in xs:
            torch.testing.assert_close(run(x), f(x))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
        assert tpu_dynamo.stats()["compiles"] == len(lengths)


def test_input_mutation_under_inference_mode():
    """Inference tensors have no version counter: correct results, re-uploaded every call."""

    def f(cache, pos, x):
        cache.index_copy_(0, pos, x)
        return cache.sum(0)

    run = compile_tpu(f)
    with torch.inference_mode():
        got, want = torch.zeros(4, 2), torch.zeros(4, 2)
        for i in range(3):
            x, pos = torch.full((1, 2), float(i + 1)), torch.tensor([i])
            torch.testing.assert_close(run(got, pos, x), f(want, pos, x))
            torch.testing.assert_close(got, want)


class TokenWise(torch.nn.Module):
    """Embedding, positions from a table prefix, MLP and layer norm: every sequence position is
    computed from its own inputs only, so padding the sequence is provably safe."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.pos = torch.nn.Parameter(torch.randn(20, 16))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, ids):
        h = self.embed(ids) + self.pos[: ids.shape[1]]
        h = self.norm(h + self.mlp(h))
        return h.softmax(-1), h.cumsum(1)


def test_buckets_pad_where_provably_safe(caplog):
    torch.manual_seed(0)
    model = TokenWise().eval()
    run = compile_tpu(model, options={"bucket_size": 8, "num_dynamic_buckets": 2})
    compiles = []
    with caplog.at_level("INFO", logger="tpu_dynamo"), torch.no_grad():
        for s in (3, 5, 8, 2, 11, 16, 19, 20):
            ids = torch.randint(0, 50, (2, s))
            torch._dynamo.mark_dynamic(ids, 1)
            want = model(ids)
            got = run(ids)
            assert [g.shape for g in got] == [w.shape for w in want]
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            compiles.append(tpu_dynamo.stats()["compiles"])
    assert "padding symbolic sizes to multiples of 8" in caplog.text
    # 2..8 share the bucket of 8, 11 and 16 that of 16; 19 and 20 lie past the last bucket (2 x 8),
    # so they compile exactly (and the 20-row position table caps any padding anyway).
    assert compiles == [1, 1, 1, 1, 2, 2, 3, 4]


def test_buckets_fall_back_to_exact_shapes_with_the_reason(caplog):
    def share(x):  # sums over the padded positions: padding would change the result
        return x / x.sum(1, keepdim=True)

    run = compile_tpu(share, options={"num_dynamic_buckets": 2, "bucket_size": 8})
    with caplog.at_level("INFO", logger="tpu_dynamo"):
        for s in (3, 5):
            x = torch.rand(2, s, 4) + 0.5
            torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(run(x), share(x))
    assert "compiling exact shapes, padding is not proven safe" in caplog.text
    assert "aten.sum.dim_IntList (node 0) reduces over a padded dimension" in caplog.text
    assert tpu_dynamo.stats()["compiles"] == 2

def test_buckets_serve_every_step_of_a_dynamic_cache_decode(caplog):
    """generate() with the default dynamic cache: each step's K/V is one longer. Padded to a
    bucket, the step appends at the true length and attention hides the padding (both read the
    length at run time), so one executable serves every length in a bucket."""
    model = tiny("llama")
    expected = generate_with_logits(model, IDS, 20)
    model.forward = compile_tpu(model.forward, options={"bucket_size": 16})
    torch._dynamo.utils.counters.clear()
    with caplog.at_level("INFO", logger="tpu_dynamo"):
        got = generate_with_logits(model, IDS, 20)
    assert_same_generation(got, expected)
    # The prompt (7 tokens) and the first step (8) as Dynamo's static graphs; then the step
    # graph for lengths 8-16 in the bucket of 16 and 17-25 in that of 32.
    assert tpu_dynamo.stats()["compiles"] == 4
    # One size per K/V length symbol: torch 2.15's Dynamo gives each layer's K and V its own, 2.11 fewer.
    padded = re.search(r"sizes \[25((, 25)*)\] run padded to \[32(, 32)*\]", caplog.text)
    assert padded
    lengths = 1 + padded.group(1).count(",")
    # The cut K/V come back contiguous, as eager's: a strided view would fail Dynamo's stride
    # guards next step and cost a fourth trace.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
    # A step reads its true length once per length symbol (4 inputs in torch 2.15, one value), each
    # an 8-byte copy into the buffer the executable keeps for it, as its token id and position
    # are; every other input is a resident weight or the last step's K/V, read where it lies.
    before = tpu_dynamo.stats()
    assert torch.equal(generate(model, IDS, 20), got.sequences)
    after = tpu_dynamo.stats()
    delta = {k: after[k] - before[k] for k in ("uploads", "uploads_staged", "resident_shared_hits")}
    assert delta["uploads_staged"] >= lengths * 18  # the 18 padded steps' lengths, at least
    assert delta["resident_shared_hits"] == 0
    # Copied otherwise: only the K/V where a step cannot read them in place, the first padded
    # step's (the first step's results are exact) and at the change of bucket (16 -> 32).
    assert delta["uploads"] - delta["uploads_staged"] == 2 * lengths


def test_a_dynamic_cache_decode_pads_to_powers_of_two_once_it_feeds_back_its_cache(caplog):
    """Without bucket options, a step graph called on the cache it returned (one longer) is a
    decode step: proven safe to pad, it pads to powers of two from its second length on rather
    than compiling every step."""
    model = tiny("llama")
    expected = generate_with_logits(model, IDS, 20)
    model.forward = compile_tpu(model.forward)
    with caplog.at_level("INFO", logger="tpu_dynamo"):
        got = generate_with_logits(model, IDS, 20)
    assert_same_generation(got, expected)
    # Prompt, first step, length 8 exactly, then 9-16 padded to 16 and 17-25 to 32.
    assert tpu_dynamo.stats()["compiles"] == 5
    assert "called on its own grown outputs" in caplog.text


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_a_padded_decode_reads_its_cache_where_the_last_step_left_it(kv_heads):
    """A padded step's K and V come back packed: the tensors the cache keeps are the first
    elements of the executable's own buffers, and the next step in the bucket reads them there
    instead of a zero-padded copy. Only the first step of a bucket copies: the cache then comes
    from a smaller buffer. With two heads, padding the sequence is no mere prefix (the layouts
    differ); with one it is, and the buffer's tail past the true length must still read as zeros."""
    model = tiny("llama", kv_heads)
    expected = generate_with_logits(model, IDS, 20)
    model.forward = compile_tpu(model.forward)
    got = generate_with_logits(model, IDS, 20)
    assert_same_generation(got, expected)
    # Lengths 9-16 run in the executable for 16 and 17-25 in the one for 32; each bucket's first
    # copies, and 16 is no padded call (its cache is the executable's size, taken as it is).
    layers = model.config.num_hidden_layers
    assert tpu_dynamo.stats()["packed_in_place"] == 2 * layers * (len(range(10, 16)) + len(range(18, 26)))


def test_buckets_pad_a_causal_prefill():
    """Causal attention with queries and keys padded alike: the padded keys come after every
    true query, so the causal mask already hides them."""
    model = tiny("qwen3")
    run = compile_tpu(model, dynamic=True, options={"bucket_size": 16})
    with torch.no_grad():
        for s in (3, 5, 8, 13):
            ids = torch.randint(1, 128, (1, s), generator=torch.Generator().manual_seed(s))
            torch.testing.assert_close(run(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    assert tpu_dynamo.stats()["compiles"] == 1


def test_buckets_pad_a_long_causal_attention_run_in_row_blocks():
    """From 512 queries a causal attention runs in blocks of 128 rows, each over the keys its
    last query sees; padded to the bucket of 768, queries and keys alike, each true query
    still sees its true keys only. Tolerance 1e-5."""

    def f(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    run = compile_tpu(f, options={"bucket_size": 256})
    for s in (520, 600, 700):
        q, k, v = (torch.randn(1, 2, s, 8) for _ in range(3))
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 2)
        torch.testing.assert_close(run(q, k, v), f(q, k, v), rtol=1e-5, atol=1e-5)
    assert tpu_dynamo.stats()["compiles"] == 1


def test_padded_keys_are_hidden_from_a_long_causal_attention_run_in_row_blocks():
    """520 causal queries over a cache of 301-400 keys plus a new one, padded to the bucket
    of 512: the row blocks read key prefixes of 128-512, which cut through the padding, and
    each hides what lies past the true count. Tolerance 1e-5."""

    def f(q, k, v, new):
        k, v = torch.cat([k, new], 2), torch.cat([v, new], 2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), k

    q = torch.randn(1, 2, 520, 8)
    calls = ((q, torch.randn(1, 2, s, 8), torch.randn(1, 2, s, 8), torch.randn(1, 2, 1, 8)) for s in (300, 350, 400))
    _matches_eager_as_the_keys_grow(f, 256, calls)
    assert tpu_dynamo.stats()["compiles"] == 1


def _matches_eager_as_the_keys_grow(f, bucket_size, calls):
    """Runs `f(q, k, v, new)` compiled with buckets on each of `calls`, k and v marked dynamic
    along their keys; every output as eager's within 1e-5."""
    run = compile_tpu(f, options={"bucket_size": bucket_size})
    for q, k, v, new in calls:
        for t in (k, v):
            torch._dynamo.mark_dynamic(t, 2)
        for g, w in zip(run(q, k, v, new), f(q, k, v, new)):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def eager_soft_capped(q, k, v):
    """Gemma 2's eager attention: scores, soft-capping, softmax, probabilities times values."""
    return torch.softmax(torch.tanh(q @ k.transpose(-1, -2) / 5) * 5, -1) @ v


@pytest.mark.parametrize("attend", [sdpa, eager_soft_capped])
def test_padded_keys_are_hidden_even_where_padding_turns_non_finite(attend):
    """Attention over keys padded to a bucket, whose padding becomes -inf keys and inf values
    (log and reciprocal of the zero padding): masked out, not multiplied by a zero weight. Written
    out, the softmax hides positions past the true count (-inf) and the product zeroes both
    operands there."""

    def f(q, k, v, new):
        k = torch.cat([k, new], 2).log()
        v = 1 / torch.cat([v, new], 2)
        return attend(q, k, v), k, v

    calls = (
        (torch.randn(1, 2, 1, 4), torch.rand(1, 2, s, 4) + 0.5, torch.rand(1, 2, s, 4) + 0.5, torch.rand(1, 2, 1, 4) + 0.5)
        for s in (3, 5, 6, 7, 9)
    )
    _matches_eager_as_the_keys_grow(f, 8, calls)
    # 3-7 share the bucket of 8 (keys 4-8), 9 that of 16.
    assert tpu_dynamo.stats()["compiles"] == 2


def test_a_padded_mask_gathered_at_key_positions_hides_its_padding():
    """A padding mask gathered at the keys' positions (how transformers builds the mask of a
    batched decode step): its padding reads past the mask's true length and turns into +inf
    (1 / 0), and batch row 1 hides every true key (0 out, as eager)."""

    def f(q, k, v, new, m, hide):
        k, v = torch.cat([k, new], 2), torch.cat([v, new], 2)
        bias = 1 / m[:, None, None, torch.arange(k.shape[2])] - 1 + hide
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias), k

    run = compile_tpu(f, options={"bucket_size": 8})
    hide = torch.tensor([0.0, float("-inf")]).view(2, 1, 1, 1)
    for s in (3, 5, 6, 7):
        q, new = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)
        k, v = torch.randn(2, 2, s, 4), torch.randn(2, 2, s, 4)
        m = torch.rand(2, s + 1) + 0.5
        for t, d in ((k, 2), (v, 2), (m, 1)):
            torch._dynamo.mark_dynamic(t, d)
        for g, w in zip(run(q, k, v, new, m, hide), f(q, k, v, new, m, hide)):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert tpu_dynamo.stats()["compiles"] == 1


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_buckets_serve_a_batched_decode_with_a_padding_mask(kind):
    """Left-padded prompts: each step builds its mask from the attention mask and the past
    length (a size used as a value, read at run time); one executable per bucket."""
    model = tiny(kind)
    ids = torch.randint(1, 128, (3, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :5] = 0
    expected = generate_with_logits(model, ids, 20, attention_mask=mask)
    model.forward = compile_tpu(model.forward, options={"bucket_size": 16})
    got = generate_with_logits(model, ids, 20, attention_mask=mask)
    assert_same_generation(got, expected)
    # The prompt, the first step's exact shapes, then past lengths 8-16 (masks one longer, padded
    # to 17 with them), 17-26.
    assert tpu_dynamo.stats()["compiles"] == 4


def test_a_sliding_window_decode_matches_eager_and_stops_compiling_once_the_window_fills():
    """Mistral's sliding window (12): the step graph also returns a number (the cache's count of
    tokens seen). Before the window fills, the step pads like any decode step (its cache keeps
    its last 11 entries: a suffix of the padded cache, all of it while the true length fits).
    Once it is full, shapes stop changing but the count keeps growing; it only enters the
    positions and the mask's offset, so the executable reads it at run time instead of
    compiling for each value (before, every step was a compile)."""
    model = tiny("mistral")
    expected = generate(model, IDS, 24)
    model.forward = compile_tpu(model.forward)
    assert torch.equal(generate(model, IDS, 24), expected)
    # Prompt, first step, second length exact, padded to 16 (past lengths 9-10), 11 exact (the
    # cache's suffix no longer holds every entry), then the full window's two graphs.
    assert tpu_dynamo.stats()["compiles"] == 7


def test_a_hybrid_decode_pads_its_growing_cache_and_keeps_the_full_window_exact(caplog):
    """Gemma 3 alternates sliding-window and full-attention layers. Once the window is full, the
    step's full-attention cache grows while the sliding one stays at its window; Dynamo traced
    the latter's values with a symbolic length too, and padding it would misalign them with its
    static keys, so the graph as a whole cannot be padded. Its growing sizes can: the steady
    ones are fixed (kept exact) and the rest pad like any decode step (40 compiles for these 40
    tokens before, one per step)."""
    model = tiny("gemma3")
    expected = generate(model, IDS, 40)
    model.forward = compile_tpu(model.forward)
    with caplog.at_level("INFO", logger="tpu_dynamo"):
        assert torch.equal(generate(model, IDS, 40), expected)
    assert "sizes [11] stay exact" in caplog.text
    assert tpu_dynamo.stats()["compiles"] == 10


def test_a_soft_capped_eager_attention_decode_pads_its_steps():
    """Gemma 2 attends eagerly (its logit soft-capping has no fused kernel): a softmax and a
    product over the padded keys, hidden at run time, so its dynamic-cache decode pads like the
    others (one compile per step before)."""
    model = tiny("gemma2")
    expected = generate_with_logits(model, IDS, 24)
    model.forward = compile_tpu(model.forward)
    assert_same_generation(generate_with_logits(model, IDS, 24), expected)
    assert tpu_dynamo.stats()["compiles"] == 9
