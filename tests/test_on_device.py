"""Calls on tensors in a GPU's memory (`Executable._on_device`): inputs read where they are,
results left where the plugin put them.

Each test runs twice: through the same path on the CPU plugin ("host", the executable's `__call__`
routed to `_on_device` with host tensors: views of torch's memory in, the plugin's results lent
to torch), and on a CUDA GPU with the XLA CUDA plugin ("cuda"), where one is (the H200 run of
`bench/device.sh`; there is none here, so that half is skipped here and runs there). Tolerances:
f32 as the CPU suite's (1e-5), bf16 one bf16 step of the outputs' magnitude (2e-2).
"""
import pytest
import torch
import transformers

import tpu_dynamo
from tpu_dynamo.executable import Executable

from conftest import compile_tpu


def _gpu_plugin() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        return tpu_dynamo.device_info()["platform"] != "cpu"
    except Exception:
        return False


@pytest.fixture(params=["host", "cuda"])
def device(request, monkeypatch):
    """The torch device the test's model and inputs live on."""
    if request.param == "cuda":
        if not _gpu_plugin():
            pytest.skip("needs a CUDA GPU and the XLA CUDA plugin (bench/device.sh runs it on the H200)")
        return torch.device("cuda")

    def through_device_path(self, args, sizes=None):
        if self.derived is not None:
            args.extend(self.derived(args))
        tensors = self._tensors(args)
        args.clear()
        return self._on_device(tensors, sizes, torch.device("cpu"))

    monkeypatch.setattr(Executable, "__call__", through_device_path)
    return torch.device("cpu")


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_reads_its_weights_where_they_are(device, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    model = model.to(device, dtype).eval()
    x = torch.randn(8, 64, device=device, dtype=dtype)
    with torch.no_grad():
        expected = model(x)
        compiled = compile_tpu(model)
        got = compiled(x)
        before = tpu_dynamo.stats()
        again = compiled(x + 1)
        after = tpu_dynamo.stats()
    assert got.device == expected.device and got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(again, model(x + 1), rtol=TOL[dtype], atol=TOL[dtype])
    # The second call views only its new input: the four weights' views are kept.
    assert after["device_views"] - before["device_views"] == 1
    assert after["uploads"] == before["uploads"]


def test_weights_are_viewed_once_even_when_changed_in_place_or_made_in_inference_mode(device):
    """A view reads the weight's memory as it is at each execute: neither an in-place update
    nor an inference tensor's missing version needs a new one."""
    with torch.inference_mode():
        model = torch.nn.Linear(16, 8).to(device)
        x = torch.randn(4, 16, device=device)
        compiled = compile_tpu(model)
        compiled(x)
        before = tpu_dynamo.stats()
        compiled(x)
        after_inference = tpu_dynamo.stats()
        model.weight.mul_(2)
        got = compiled(x)
        after_update = tpu_dynamo.stats()
        expected = model(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert after_inference["device_views"] - before["device_views"] == 1  # x alone
    assert after_update["device_views"] - after_inference["device_views"] == 1


def test_results_outlive_the_next_calls_and_stay_correct(device):
    """A result is the plugin's memory, lent to torch: later executes must not reuse it while
    torch holds it, and after torch lets go it is freed."""
    f = compile_tpu(lambda a, b: (a @ b).relu() + 1)
    xs = [torch.randn(32, 32, device=device) for _ in range(6)]
    kept = [f(x, x.T) for x in xs]
    for x, got in zip(xs, kept):
        torch.testing.assert_close(got, (x @ x.T).relu() + 1, rtol=1e-5, atol=1e-5)
    for _ in range(20):
        f(xs[0], xs[1])  # released at once; each call destroys what the previous ones released
    torch.testing.assert_close(kept[-1], (xs[-1] @ xs[-1].T).relu() + 1, rtol=1e-5, atol=1e-5)


def test_an_updated_buffer_gets_its_new_value_and_one_version_bump(device):
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("total", torch.zeros(4))

        def forward(self, x):
            self.total.add_(x.sum(0))
            return x * 2

    eager, model = Counter().to(device), Counter().to(device)
    compiled = compile_tpu(model)
    for step in range(3):
        x = torch.randn(5, 4, device=device)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), eager(x))
        torch.testing.assert_close(model.total, eager.total, rtol=1e-5, atol=1e-5)
    assert model.total._version == eager.total._version


@pytest.mark.parametrize("cache", [None, "static"])
def test_generate_matches_eager(device, cache):
    """With the default dynamic cache, decode steps pad the cache to the executable's bucket and
    cut the results back; with a static one, each step updates the cache in place. On the device
    both happen there."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(config).eval().to(device)
    ids = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(3)).to(device)

    def generate():
        with torch.no_grad():
            return model.generate(
                ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                cache_implementation=cache,
            )

    expected = generate()
    model.forward = compile_tpu(model.forward)
    assert torch.equal(generate(), expected)


def test_a_cuda_tensor_on_a_cpu_plugin_says_what_to_install():
    if not torch.cuda.is_available() or _gpu_plugin():
        pytest.skip("needs a CUDA GPU with the CPU plugin in use")
    f = compile_tpu(lambda x: x + 1)
    with pytest.raises(Exception, match="jax-cuda13-pjrt"):
        f(torch.ones(3, device="cuda"))


ATTENTION_KERNELS = {
    "flash": lambda q, k, v, mask: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=True)[0],
    "cudnn": lambda q, k, v, mask: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, mask, False)[0],
    "efficient": lambda q, k, v, mask: torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, False)[0],
}


@pytest.mark.parametrize("kernel", list(ATTENTION_KERNELS))
def test_a_gpu_attention_kernel_is_lowered_as_the_attention_it_computes(kernel):
    """SDPA on CUDA tensors reaches the backend as one of these kernels; traced here on CPU
    tensors (their fake kernels know no device), each must give SDPA's math."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g) for _ in range(3))
    mask = torch.randn(2, 1, 9, 9, generator=g)
    got = compile_tpu(ATTENTION_KERNELS[kernel])(q, k, v, mask)
    if kernel == "flash":
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
