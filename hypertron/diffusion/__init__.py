"""Diffusion inference: Stable Diffusion 1.x/2.x, SDXL and Flux from diffusers folders (issue 39).

:mod:`hypertron.diffusion.generate` (``hypertron diffuse``'s work) over :mod:`hypertron.diffusion.sampling`
(prompt embeddings, noise, and the one compiled program from them to pixels) and
:mod:`hypertron.diffusion.placement` (a pipeline's weights on a mesh, int8 or fp8 matmuls) over
:mod:`hypertron.diffusion.pipeline` (a ``model_index.json`` folder, read strictly) over
:mod:`hypertron.diffusion.schedulers` (the samplers of a ``scheduler_config.json``: the schedule on
the host, a pure JAX step for ``lax.scan``), :mod:`hypertron.diffusion.text_encoders` (CLIP and T5
encoders and their prompt ids), :mod:`hypertron.diffusion.vae` (``AutoencoderKL``),
:mod:`hypertron.diffusion.unet` (``UNet2DConditionModel``: SD 1.x/2.x and SDXL's ``text_time``; its
cross-attention blocks in :mod:`hypertron.diffusion.transformer2d`) and :mod:`hypertron.diffusion.flux`
(``FluxTransformer2DModel``, FluxPipeline's latent packing and position ids) over
:mod:`hypertron.diffusion.layers` (the NHWC conv blocks the VAE and UNet share, the sinusoidal
timestep embedding),
:mod:`hypertron.diffusion.weights` (a component's ``diffusion_pytorch_model.safetensors``) and
:mod:`hypertron.diffusion.errors` (``DiffusionError``). This
module imports none of them, so importing one costs only what it needs.
"""
