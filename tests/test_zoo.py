"""Model zoo: tiny random-weight transformers/diffusers models, compiled with fullgraph=True and
compared with eager. Metric: max|eager - ours| / max|eager| over every output tensor."""
import pytest
import torch

from conftest import TORCH_VERSION, compile_tpu

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _ids(vocab, n=12, batch=1):
    return torch.randint(0, vocab, (batch, n))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64)
    return GPT2LMHeadModel(cfg), {"input_ids": _ids(100)}


def _llama_cfg(cls, **kw):
    return cls(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, head_dim=8, **kw,
    )


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(_llama_cfg(LlamaConfig)), {"input_ids": _ids(100)}


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(_llama_cfg(Qwen3Config)), {"input_ids": _ids(100)}


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = _llama_cfg(Qwen3MoeConfig, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     decoder_sparse_step=1, mlp_only_layers=[])
    return Qwen3MoeForCausalLM(cfg), {"input_ids": _ids(100)}


def gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = _llama_cfg(Gemma3TextConfig, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    return Gemma3ForCausalLM(cfg), {"input_ids": _ids(100)}


def bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                     vocab_size=100, max_position_embeddings=64)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    return BertModel(cfg), {"input_ids": _ids(100, batch=2), "attention_mask": mask}


def vit():
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                    image_size=16, patch_size=4, num_channels=3)
    return ViTModel(cfg), {"pixel_values": torch.randn(1, 3, 16, 16)}


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8, d_ff=64, num_heads=4,
                   vocab_size=100, decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg), {"input_ids": _ids(100), "decoder_input_ids": _ids(100, 6)}


def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(encoder_layers=2, decoder_layers=2, d_model=32, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100,
                        num_mel_bins=8, max_source_positions=16, max_target_positions=32,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return WhisperForConditionalGeneration(cfg), {
        "input_features": torch.randn(1, 8, 32), "decoder_input_ids": _ids(100, 6)}


def sd3():
    from diffusers import SD3Transformer2DModel

    m = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                              attention_head_dim=8, num_attention_heads=4, joint_attention_dim=32,
                              caption_projection_dim=32, pooled_projection_dim=16)
    return m, {"hidden_states": torch.randn(1, 4, 8, 8), "encoder_hidden_states": torch.randn(1, 6, 32),
               "pooled_projections": torch.randn(1, 16), "timestep": torch.tensor([3.0])}


def sd35():
    """SD3.5's layers: RMS-normed queries and keys, and a second (image-only) attention in the
    first layer."""
    from diffusers import SD3Transformer2DModel

    m = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                              attention_head_dim=8, num_attention_heads=4, joint_attention_dim=32,
                              caption_projection_dim=32, pooled_projection_dim=16, dual_attention_layers=(0,),
                              qk_norm="rms_norm")
    return m, {"hidden_states": torch.randn(1, 4, 8, 8), "encoder_hidden_states": torch.randn(1, 6, 32),
               "pooled_projections": torch.randn(1, 16), "timestep": torch.tensor([3.0])}


def flux():
    from diffusers import FluxTransformer2DModel

    m = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                               attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                               pooled_projection_dim=16, guidance_embeds=False, axes_dims_rope=(2, 2, 4))
    return m, {"hidden_states": torch.randn(1, 16, 8), "encoder_hidden_states": torch.randn(1, 6, 16),
               "pooled_projections": torch.randn(1, 16), "timestep": torch.tensor([0.5]),
               "img_ids": torch.randn(16, 3), "txt_ids": torch.zeros(6, 3)}


def unet():
    from diffusers import UNet2DConditionModel

    m = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                             block_out_channels=(32, 64), norm_num_groups=8, cross_attention_dim=16,
                             attention_head_dim=8,
                             down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                             up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    return m, {"sample": torch.randn(1, 4, 8, 8), "timestep": torch.tensor([10]),
               "encoder_hidden_states": torch.randn(1, 6, 16)}


class _Decode(torch.nn.Module):
    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, z):
        return self.vae.decode(z).sample


def vae_decoder():
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32),
                        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                        norm_num_groups=8, sample_size=16)
    return _Decode(vae), {"z": torch.randn(1, 4, 8, 8)}


def qwen_image():
    from diffusers import QwenImageTransformer2DModel

    m = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
                                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                    axes_dims_rope=(4, 6, 6))
    return m, {"hidden_states": torch.randn(1, 16, 16), "encoder_hidden_states": torch.randn(1, 6, 16),
               "encoder_hidden_states_mask": torch.ones(1, 6), "timestep": torch.tensor([0.5]),
               "img_shapes": [(1, 4, 4)]}


MODELS = [gpt2, llama, qwen3, qwen3_moe, bert, vit, t5, whisper, gemma3, sd3, sd35, flux, unet, vae_decoder, qwen_image]
# Transformers' T5 and Whisper deep-copy their config in the forward, which Dynamo traces in torch
# 2.13 and 2.15 (torch 2.11's: `Unsupported: copy.deepcopy()`, whatever the backend).
_DEEPCOPY = pytest.mark.skipif(TORCH_VERSION < (2, 13), reason="needs a Dynamo that traces copy.deepcopy")
CASES = [
    pytest.param(m, d, marks=_DEEPCOPY if m in (t5, whisper) else (), id=f"{m.__name__}-{str(d).removeprefix('torch.')}")
    for m, d in [(m, torch.float32) for m in MODELS] + [(llama, torch.bfloat16), (sd3, torch.bfloat16), (sd35, torch.bfloat16)]
]


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict) or hasattr(out, "values"):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def relative_error(want, got) -> float:
    want, got = _tensors(want), _tensors(got)
    assert len(want) == len(got) and want
    scale = max(w.double().abs().max().item() for w in want)
    return max((w.double() - g.double()).abs().max().item() for w, g in zip(want, got)) / scale


@pytest.mark.parametrize("build,dtype", CASES)
def test_zoo_model_matches_eager(build, dtype):
    torch.manual_seed(0)
    model, inputs = build()
    model = model.eval().to(dtype)
    inputs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in inputs.items()}
    with torch.no_grad():
        want = model(**inputs)
        got = compile_tpu(model)(**inputs)
    err = relative_error(want, got)
    print(f"{build.__name__} {dtype}: {err:.3g}")
    assert err <= TOL[dtype]
