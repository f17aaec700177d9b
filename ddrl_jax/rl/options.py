"""Every key of a config's `rl` section, typed once: `RLOptions` (names, types, defaults) and `CHOICES` (the
values each enumerated key accepts). The losses, `Algorithm`s and the config checks (`ddrl_jax.config`)
read them from here, so a value is spelled in one place.

Keys (configs/common.py's `rl` section holds the same names and defaults, except loss_scale: 1 here, the
functional loss's neutral scale, 10 in the configs, cosmos-rl's; a test keeps them so):
  train_steps          trained step indices (fixed-step algorithms) or the candidate pool (random-step
                       ones); None: the algorithm's default
  train_fraction       random-step algorithms: the fraction of the pool trained per rollout
  clip_range           PPO clip of the ratio
  adv_clip, adv_eps    advantage clamp and the std floor of the normalization
  adv_normalization    'cosmos_rl', 'flow_grpo' or 'dance_grpo' (rl/advantages.py)
  adv_global_std       'flow_grpo' normalization: the std of the whole batch (else per prompt)
  adv_transform        '' (z-score), 'neg_exp' (-exp(-A)) or 'exact' (-exp(-(r - Z) / beta))
  failed_advantage     a failed sample's advantage: 'zero' or 'transformed_zero' (cosmos-rl: lambda(0))
  exact_beta, exact_log_partition   the 'exact' transform's beta and Z (None: the group estimate)
  log_ratio            '' (the algorithm's), 'cosmos_rl' (cosmos-rl's unnormalized form) or 'gaussian'
  old_mean             'rollout' (the rollout's stored means) or 'detached' (stop_gradient(mu_theta))
  drop_zero_advantages FlowGRPO's filtered mean over the rollouts with a non-zero advantage
  pg_weight            the policy gradient's weight (0: a control without it)
  data_beta            DDRL's data-term weight
  data_loss_steps      'full', 'first' (cosmos-rl's data_on_first_only) or 'random_step' ('reduced')
  data_noise           'rollout' (the rollout's initial noise) or 'fresh'
  cond_dropout         the data term's null-condition probability
  data_weighting       'path_kl' (the sampler's exact per-step path-KL weight; the default), 'cosmos_rl'
                       (t^2 + (1-t)^2), 'eps_mse' ((1-t)^2) or 'none'
  kl_beta, kl_form     the reverse KL to the reference: weight, 'exact' or 'flow_grpo'
  loss_scale           multiplies the whole loss (cosmos-rl: 10)
  nft_beta, nft_old_decay   DiffusionNFT's mixing strength and its old policy's EMA schedule

Naming: 'cosmos_rl' names cosmos-rl's algorithm conventions (its log-ratio form, advantage normalization
and data weighting), not the Cosmos network family. The values configs wrote before, 'cosmos', are still
accepted and mean the same (`canonical`).
"""
import dataclasses
from typing import Optional, Tuple

DATA_STEP_MODES = ('full', 'first', 'random_step', 'reduced')   # 'reduced': 'random_step's old name
KL_FORMS = ('exact', 'flow_grpo')
LOG_RATIO_FORMS = ('cosmos_rl', 'gaussian')
NORMALIZATIONS = ('cosmos_rl', 'flow_grpo', 'dance_grpo')
WEIGHTINGS = ('cosmos_rl', 'path_kl', 'eps_mse', 'none')
ADV_TRANSFORMS = ('', 'neg_exp', 'exact')
FAILED_MODES = ('zero', 'transformed_zero')
OLD_MEANS = ('rollout', 'detached')
DATA_NOISES = ('rollout', 'fresh')

# The accepted values of each enumerated key (aliases included: see ALIASES).
CHOICES = {
    'adv_normalization': NORMALIZATIONS + ('cosmos',),
    'adv_transform': ADV_TRANSFORMS,
    'failed_advantage': FAILED_MODES,
    'log_ratio': ('',) + LOG_RATIO_FORMS + ('cosmos',),
    'old_mean': OLD_MEANS,
    'data_loss_steps': DATA_STEP_MODES,
    'data_noise': DATA_NOISES,
    'data_weighting': WEIGHTINGS + ('cosmos',),
    'kl_form': KL_FORMS,
}
# The keys `RLOptions.problems` checks on their own (choices and ranges).
CHECKED_KEYS = tuple(CHOICES) + ('clip_range', 'train_fraction', 'adv_eps', 'data_beta', 'cond_dropout',
                                 'kl_beta', 'exact_beta')
# Old spellings, still accepted: 'cosmos' for cosmos-rl's conventions.
ALIASES = {'cosmos': 'cosmos_rl', 'reduced': 'random_step'}


def canonical(value):
  """The current name of an accepted value ('cosmos' -> 'cosmos_rl'); other values unchanged."""
  return ALIASES.get(value, value) if isinstance(value, str) else value


@dataclasses.dataclass(frozen=True)
class RLOptions:
  """The `rl` section as a typed value (see the module docstring for each key)."""
  train_steps: Optional[Tuple[int, ...]] = None
  train_fraction: float = 0.6
  clip_range: float = 1e-4
  adv_clip: float = 5.0
  adv_eps: float = 1e-4
  adv_normalization: str = 'cosmos_rl'
  adv_global_std: bool = True
  adv_transform: str = ''
  failed_advantage: str = 'zero'
  exact_beta: float = 1.0
  exact_log_partition: Optional[float] = None
  log_ratio: str = ''
  old_mean: str = 'rollout'
  drop_zero_advantages: bool = False
  pg_weight: float = 1.0
  data_beta: float = 0.01
  data_loss_steps: str = 'full'
  data_noise: str = 'rollout'
  cond_dropout: float = 0.2
  data_weighting: str = 'path_kl'     # issue 45: cosmos-rl's shape collapses off the data (README)
  kl_beta: float = 0.0
  kl_form: str = 'exact'
  loss_scale: float = 1.0          # the functional loss's neutral scale; configs set cosmos-rl's 10
  nft_beta: float = 1.0
  nft_old_decay: int = 1

  def __post_init__(self):
    for name in CHOICES:       # one spelling inside the library: 'cosmos' -> 'cosmos_rl'
      object.__setattr__(self, name, canonical(getattr(self, name)))

  @classmethod
  def from_mapping(cls, mapping):
    """RLOptions from a mapping with these keys (e.g. config.rl); missing keys take the defaults. Raises
    ValueError naming any key RLOptions does not know (a typo would otherwise be ignored)."""
    names = [f.name for f in dataclasses.fields(cls)]
    keys = list(mapping.keys()) if hasattr(mapping, 'keys') else list(mapping)
    unknown = sorted(set(keys) - set(names))
    if unknown:
      raise ValueError(f'rl options {unknown}: unknown; known: {names}')
    values = {n: mapping[n] for n in names if n in keys}
    if values.get('train_steps') is not None:
      values['train_steps'] = tuple(int(s) for s in values['train_steps'])
    return cls(**values)

  def problems(self):
    """[(key, value, what is wrong)] of the single-key checks: choices and ranges (the checks that need
    the sampler or the algorithm are `ddrl_jax.config.validate`'s and `Algorithm.problems`')."""
    out = [(k, getattr(self, k), f'known: {CHOICES[k]}') for k in CHOICES if getattr(self, k) not in
           tuple(canonical(c) for c in CHOICES[k])]
    ranges = [
        ('clip_range', self.clip_range > 0, 'the PPO clip range must be > 0'),
        ('train_fraction', 0 < self.train_fraction <= 1, 'must be in (0, 1]'),
        ('adv_eps', self.adv_eps > 0, 'must be > 0 (it keeps a zero-std group finite)'),
        ('data_beta', self.data_beta >= 0, 'must be >= 0'),
        ('cond_dropout', 0 <= self.cond_dropout < 1, 'must be in [0, 1)'),
        ('kl_beta', self.kl_beta >= 0, 'must be >= 0'),
    ]
    if self.adv_transform == 'exact':
      ranges.append(('exact_beta', self.exact_beta > 0, 'must be > 0'))
    out += [(k, getattr(self, k), why) for k, ok, why in ranges if not ok]
    return out
