"""Prompt encoding of whole pipeline folders against the diffusers pipelines' own ``encode_prompt``
(issue 39, point 3): SDXL's two CLIP encoders (penultimate states concatenated, the second's
projected pooled output, zeros for an empty negative prompt as ``force_zeros_for_empty_prompt``
says, a given negative prompt encoded) and Flux's T5 states beside CLIP's pooled output, on the
tiny folders of ``tests/support/diffusion_folders.py`` (also ``bench/diffuse.py``'s), loaded by
``load_pipeline``."""

from __future__ import annotations

import numpy as np
import pytest

from hypertron.diffusion import sampling
from hypertron.diffusion.pipeline import load_pipeline
from support import diffusion_folders  # tests/support

PROMPTS = ["a photo of a red cat", "Blue DOG, of a photo!"]


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    return diffusion_folders.tiny_sdxl(tmp_path_factory.mktemp("sdxl"))


@pytest.mark.parametrize("negative", [None, ["a dog", "red"]])
def test_sdxl_prompts_are_sdxl_pipelines(sdxl, negative):
    torch = pytest.importorskip("torch")
    folder, reference = sdxl
    got = sampling.encode_prompts(load_pipeline(folder), PROMPTS, negative)
    with torch.no_grad():
        want = reference.encode_prompt(PROMPTS, device="cpu", num_images_per_prompt=1,
                                       do_classifier_free_guidance=True, negative_prompt=negative)
    for key, value in zip(("context", "negative_context", "pooled", "negative_pooled"), want):
        np.testing.assert_allclose(np.asarray(got[key]), value.numpy(), atol=1e-4, rtol=0, err_msg=key)


def test_flux_prompts_are_flux_pipelines(tmp_path_factory):
    torch = pytest.importorskip("torch")
    folder, reference = diffusion_folders.tiny_flux(tmp_path_factory.mktemp("flux"))
    got = sampling.encode_prompts(load_pipeline(folder), PROMPTS, cfg=False, max_sequence_length=16)
    with torch.no_grad():
        context, pooled, _ = reference.encode_prompt(PROMPTS, None, device="cpu", max_sequence_length=16)
    np.testing.assert_allclose(np.asarray(got["context"]), context.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(got["pooled"]), pooled.numpy(), atol=1e-4, rtol=0)

