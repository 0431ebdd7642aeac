"""The benchmark's models: tiny random-weight configs (no downloads), built with fixed seeds so
every backend and every process sees identical weights and inputs."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

SEQ = 128
# A long prompt's tokens (`-1k` models): where attention's [L, L] scores outgrow the caches.
LONG = 1024
PROMPT, NEW_TOKENS = 16, 32


@dataclass
class Case:
    """`module(*inputs)` is one timed call; `decode` marks a `generate()` timed per token."""

    module: torch.nn.Module
    inputs: tuple[Any, ...]
    decode: bool = False
    transformer: bool = True


def _gpt2(batch: int) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=SEQ, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    return Case(model, (torch.randint(0, config.vocab_size, (batch, SEQ)),))


def _gpt2_124m(seq: int = SEQ) -> Case:
    """GPT-2 small's architecture (124 M parameters: transformers' GPT2Config defaults)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config()
    return Case(GPT2LMHeadModel(config), (torch.randint(0, config.vocab_size, (1, seq)),))


def _smollm_135m_model() -> torch.nn.Module:
    """A Llama of SmolLM-135M's configuration (135 M parameters, grouped-query attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )
    return LlamaForCausalLM(config)


def _smollm_135m(seq: int = SEQ) -> Case:
    model = _smollm_135m_model()
    return Case(model, (torch.randint(0, model.config.vocab_size, (1, seq)),))


def _smollm_135m_decode(batch: int = 1, cache_implementation: str | None = None) -> Case:
    model = _smollm_135m_model()
    return Case(_Greedy(model, cache_implementation), (torch.randint(0, model.config.vocab_size, (batch, PROMPT)),), decode=True)


def _llama_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256,
    )
    return LlamaForCausalLM(config)


def _llama(batch: int) -> Case:
    return Case(_llama_model(), (torch.randint(0, 1000, (batch, SEQ)),))


class _Greedy(torch.nn.Module):
    """Greedy `generate()` of NEW_TOKENS tokens with the default (dynamic) cache, or with the
    `cache_implementation` transformers names (`"static"`: preallocated at the generation's
    length and updated in place, as transformers suggests for `torch.compile`); only the model's
    forward is compiled, as `model.compile()` does."""

    def __init__(self, model: torch.nn.Module, cache_implementation: str | None = None):
        super().__init__()
        self.model, self.cache_implementation = model, cache_implementation

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.generate(
            input_ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
            cache_implementation=self.cache_implementation,
        )


def _llama_decode() -> Case:
    return Case(_Greedy(_llama_model()), (torch.randint(0, 1000, (1, PROMPT)),), decode=True)


def _sd3() -> Case:
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
        attention_head_dim=8, num_attention_heads=4, joint_attention_dim=32,
        caption_projection_dim=32, pooled_projection_dim=64,
    )
    inputs = (torch.randn(1, 4, 32, 32), torch.randn(1, 8, 32), torch.randn(1, 64), torch.tensor([500.0]))
    return Case(model, inputs)


def _sd35_medium_2l() -> Case:
    """Two layers of Stable Diffusion 3.5 Medium's transformer at its real width (24 heads of 64,
    RMS-normed queries and keys, the first layer with its second, image-only attention; 2 of its
    24 layers, 175 M parameters) on 32x32 latents (a 256x256 image) and the pipeline's 333 prompt
    tokens (77 CLIP + 256 T5), batch 2 as classifier-free guidance runs it."""
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel(
        sample_size=128, num_layers=2, attention_head_dim=64, num_attention_heads=24,
        caption_projection_dim=1536, pos_embed_max_size=384, dual_attention_layers=(0,), qk_norm="rms_norm",
    )
    inputs = (torch.randn(2, 16, 32, 32), torch.randn(2, 333, 4096), torch.randn(2, 2048), torch.tensor([500.0, 500.0]))
    return Case(model, inputs)


def _flux() -> Case:
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6),
    )
    image, text = 256, 8
    inputs = (
        torch.randn(1, image, 16), torch.randn(1, text, 32), torch.randn(1, 32), torch.tensor([0.5]),
        torch.zeros(image, 3), torch.zeros(text, 3),
    )
    return Case(_Positional(model, "hidden_states encoder_hidden_states pooled_projections timestep img_ids txt_ids"), inputs)


def _unet() -> Case:
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32,
    )
    inputs = (torch.randn(1, 4, 32, 32), torch.tensor([500.0]), torch.randn(1, 8, 32))
    return Case(model, inputs, transformer=False)


def _unet_sd15() -> Case:
    """Stable Diffusion 1.5's UNet (860 M parameters: diffusers' defaults with SD1.5's 768-wide
    text states) at 32x32 latents (a 256x256 image), batch 2 as classifier-free guidance runs it."""
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(cross_attention_dim=768, attention_head_dim=8)
    inputs = (torch.randn(2, 4, 32, 32), torch.tensor([500.0, 500.0]), torch.randn(2, 77, 768))
    return Case(model, inputs, transformer=False)


class _Decode(torch.nn.Module):
    """A VAE's `decode(latents)`, returning the image tensor."""

    def __init__(self, vae: torch.nn.Module):
        super().__init__()
        self.vae = vae

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latents, return_dict=False)[0]


def _vae_sd15_decode() -> Case:
    """Stable Diffusion 1.5's VAE decoder (diffusers' AutoencoderKL with SD's four blocks of 128-512
    channels, 84 M parameters in all) decoding 32x32 latents to a 256x256 image, as a pipeline
    does after its last step."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4, sample_size=512,
    )
    return Case(_Decode(vae), (torch.randn(1, 4, 32, 32),), transformer=False)


class _Positional(torch.nn.Module):
    """Calls a keyword-only diffusers forward with positional inputs; returns the tensor."""

    def __init__(self, model: torch.nn.Module, names: str):
        super().__init__()
        self.model, self.names = model, names.split()

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, inputs)), return_dict=False)[0]


class _Micro(torch.nn.Module):
    """Ten elementwise ops on 1 K elements: the compute is negligible, so the call measures
    dispatch overhead."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0 + 1.0
        y = torch.sin(y) * torch.cos(x)
        y = torch.exp(-y.abs()) - x
        y = torch.tanh(y) / (1.0 + x * x)
        return torch.relu(y)


def _micro() -> Case:
    return Case(_Micro(), (torch.randn(1024),), transformer=False)


MODELS: dict[str, Callable[[], Case]] = {
    "gpt2-b1": lambda: _gpt2(1),
    "gpt2-b8": lambda: _gpt2(8),
    "llama-b1": lambda: _llama(1),
    "llama-b8": lambda: _llama(8),
    "llama-decode": _llama_decode,
    "sd3": _sd3,
    "flux": _flux,
    "unet": _unet,
    "micro": _micro,
    "gpt2-124m-b1": _gpt2_124m,
    "smollm-135m-b1": _smollm_135m,
    "smollm-135m-decode": _smollm_135m_decode,
    "smollm-135m-decode-b8": lambda: _smollm_135m_decode(8),
    "smollm-135m-decode-static": lambda: _smollm_135m_decode(cache_implementation="static"),
    "gpt2-124m-1k": lambda: _gpt2_124m(LONG),
    "smollm-135m-1k": lambda: _smollm_135m(LONG),
    "unet-sd15": _unet_sd15,
    "vae-sd15-decode": _vae_sd15_decode,
    "sd35-medium-2l": _sd35_medium_2l,
}

# Real models' sizes, random weights: not in a default run (each call takes ~0.3 s here); run them
# with `--models gpt2-124m-b1 smollm-135m-b1 --label full-size` (the decode: `--models
# smollm-135m-decode --dtype bf16`; a 1024-token prompt: `--models gpt2-124m-1k smollm-135m-1k
# --label long-prompt`; SD1.5's UNet: `--models unet-sd15 --label unet-full-size`; its VAE's
# decoder: `--models vae-sd15-decode --label vae-full-size`; two of SD3.5 Medium's layers:
# `--models sd35-medium-2l --calls 10 --label sd35-medium`; eight prompts decoded together:
# `--models smollm-135m-decode-b8 --calls 10 --processes 1 --no-cold --label decode-b8`; with
# transformers' static cache: `--models smollm-135m-decode-static ... --label decode-static`).
FULL_SIZE = [
    "gpt2-124m-b1", "smollm-135m-b1", "smollm-135m-decode", "smollm-135m-decode-b8", "smollm-135m-decode-static",
    "gpt2-124m-1k", "smollm-135m-1k", "unet-sd15", "vae-sd15-decode", "sd35-medium-2l",
]

# Cold first calls are timed once per model (not per batch size): each Inductor one takes ~15 s.
# The decode's is its first generate(), whose three graphs (the prompt's, the first step's, the
# later steps' symbolic one) all compile in it.
COLD = ["gpt2-b1", "llama-b1", "llama-decode", "sd3", "flux", "unet", "micro", *FULL_SIZE]


def build(name: str, device: str, dtype: torch.dtype) -> Case:
    torch.manual_seed(0)
    case = MODELS[name]()
    case.module = case.module.eval().to(device=device, dtype=dtype)
    case.inputs = tuple(
        t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for t in case.inputs
    )
    return case
