"""A Diffusers StableDiffusion3Pipeline from tiny random-weight configs, its transformer compiled
with backend="tpu", driven by prompt embeddings (no text encoders, no downloads); writes a PNG."""
import sys
import time

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

import tpu_dynamo
from _report import report


def build_pipeline() -> StableDiffusion3Pipeline:
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
        attention_head_dim=8, num_attention_heads=4, joint_attention_dim=32,
        caption_projection_dim=32, pooled_projection_dim=64,
    )
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64),
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
        norm_num_groups=32, sample_size=64, scaling_factor=1.5305, shift_factor=0.0609,
    )
    return StableDiffusion3Pipeline(
        transformer=transformer.eval(), vae=vae.eval(), scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
        text_encoder_3=None, tokenizer_3=None,
    )


def generate(pipe: StableDiffusion3Pipeline, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randn(1, 8, 32, generator=generator)
    pooled = torch.randn(1, 64, generator=generator)
    return pipe(
        prompt_embeds=prompt, pooled_prompt_embeds=pooled,
        negative_prompt_embeds=prompt, negative_pooled_prompt_embeds=pooled,
        height=64, width=64, num_inference_steps=4, generator=generator, output_type="pt",
    ).images


def main(image_path: str = "sd3_tiny.png") -> dict:
    pipe = build_pipeline()
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        eager = generate(pipe, seed=1)
        pipe.transformer.compile(backend="tpu", fullgraph=True, dynamic=False)
        tpu_dynamo.reset_stats()
        compiled = generate(pipe, seed=1)
        compiles_after_first = tpu_dynamo.stats()["compiles"]
        start = time.perf_counter()
        generate(pipe, seed=2)
        second_call_s = time.perf_counter() - start
    new_compiles = tpu_dynamo.stats()["compiles"] - compiles_after_first
    image = (compiled[0].permute(1, 2, 0).clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    from PIL import Image

    Image.fromarray(image).save(image_path)
    return report("sd3", eager, compiled, second_call_new_compiles=new_compiles,
                  second_call_s=second_call_s, image=image_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
