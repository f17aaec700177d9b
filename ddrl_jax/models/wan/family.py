"""Wan2.1 converters for `python -m ddrl_jax.models.convert` (the VAE; the DiT family joins later).

Original Wan2.1 VAE names (`Wan2.1_VAE.pth`, Cosmos' `tokenizer.pth`) are renamed to diffusers'
`AutoencoderKLWan` names first (`models.convert.wan_original_to_diffusers`).
"""
from ddrl_jax.models import family as family_lib
from ddrl_jax.models.wan import vae as wan_vae
from ddrl_jax.models.wan import vae_convert


def _convert_vae(state_dict, config):
  from ddrl_jax.models import convert  # pylint: disable=g-import-not-at-top
  if convert.is_wan_original(state_dict):
    return vae_convert.convert_diffusers_vae_state_dict(
        convert.wan_original_to_diffusers(state_dict, config), config), 'wan_original'
  return vae_convert.convert_diffusers_vae_state_dict(state_dict, config), 'diffusers'


def _converter(preset):
  return family_lib.Converter(
      make_config=lambda param_dtype: preset(param_dtype=param_dtype),
      abstract=lambda config: vae_convert.abstract_params(config)[0],
      convert=_convert_vae, subfolder='vae')


CONVERTERS = {'wan21_vae': _converter(wan_vae.wan21), 'wan_tiny': _converter(wan_vae.tiny)}
