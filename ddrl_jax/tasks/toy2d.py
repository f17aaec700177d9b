"""2-D Gaussian-mixture task with a closed-form tilted optimum (the Theorem 3.1 check).

Data: p_data = sum_k pi_k N(mu_k, s^2 I). Reward: r(x) = w . x. Then
  p*(x) ∝ p_data(x) exp(r(x) / beta) = sum_k pi*_k N(mu_k + s^2 w / beta, s^2 I),
  pi*_k ∝ pi_k exp(w . mu_k / beta),   Z = beta log E_pdata[e^{r/beta}] = beta log sum_k pi_k e^{w.mu_k/beta} + s^2|w|^2/(2 beta).
so the tilt reweights the components and shifts each by s^2 w / beta.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddrl_jax import parallel
from ddrl_jax.rl import diffusion_loss
from ddrl_jax.tasks import base


# ---------------------------------------------------------------------------------------------- math
def gmm_sample(key, num, means, std, weights):
  """(num, 2) samples of sum_k weights_k N(means_k, std^2 I)."""
  k_comp, k_noise = jax.random.split(key)
  comp = jax.random.categorical(k_comp, jnp.log(jnp.asarray(weights)), shape=(num,))
  return jnp.asarray(means)[comp] + std * jax.random.normal(k_noise, (num, 2))


def gmm_log_density(x, means, std, weights):
  """(num,) log p(x) of the isotropic mixture. x: (num, 2)."""
  means = jnp.asarray(means)
  sq = ((x[:, None, :] - means[None]) ** 2).sum(-1)
  log_comp = -sq / (2 * std**2) - np.log(2 * np.pi * std**2)
  return jax.scipy.special.logsumexp(log_comp + jnp.log(jnp.asarray(weights)), axis=1)


def tilted_gmm(means, std, weights, w, beta):
  """Closed form of p* ∝ p_data exp(w.x / beta): (means*, weights*) (std is unchanged)."""
  means, weights, w = (np.asarray(a, np.float64) for a in (means, weights, w))
  logits = np.log(weights) + means @ w / beta
  new_weights = np.exp(logits - logits.max())
  return means + std**2 * w / beta, new_weights / new_weights.sum()


def log_partition(means, std, weights, w, beta):
  """Z = beta log E_pdata[exp(w.x / beta)], exactly."""
  means, weights, w = (np.asarray(a, np.float64) for a in (means, weights, w))
  logits = np.log(weights) + means @ w / beta
  m = logits.max()
  return beta * (m + np.log(np.exp(logits - m).sum())) + std**2 * (w @ w) / (2 * beta)


def sliced_wasserstein(a, b, key, num_projections=256):
  """Sliced 1-Wasserstein distance between two equal-size point clouds (n, d)."""
  dirs = jax.random.normal(key, (num_projections, a.shape[1]))
  dirs = dirs / jnp.linalg.norm(dirs, axis=1, keepdims=True)
  pa = jnp.sort(a @ dirs.T, axis=0)
  pb = jnp.sort(b @ dirs.T, axis=0)
  return jnp.abs(pa - pb).mean()


def off_manifold_fraction(x, means, std, num_std=3.0):
  """Fraction of samples farther than num_std * std from every component mean."""
  dist = jnp.linalg.norm(x[:, None, :] - jnp.asarray(means)[None], axis=-1)
  return (dist.min(axis=1) > num_std * std).mean()


# ------------------------------------------------------------------------------------------ pretrain
def pretrain(apply_fn, params, sample_data, *, steps, batch_size, learning_rate, key):
  """Trains the base model on data with the diffusion loss only (the library's `velocity_loss`).

  t ~ U(0, 1) clipped to [1e-3, 1 - 1e-3], cosmos' t^2 + (1-t)^2 weight, no condition (zeros).
  Returns (params, final loss).
  """
  opt = optax.adamw(optax.cosine_decay_schedule(learning_rate, steps, alpha=0.05), weight_decay=0.0)
  opt_state = opt.init(params)

  def loss_fn(p, k):
    k_x, k_t, k_n = jax.random.split(k, 3)
    x0 = sample_data(k_x, batch_size)
    t = jax.random.uniform(k_t, (batch_size,), minval=1e-3, maxval=1 - 1e-3)
    noise = jax.random.normal(k_n, x0.shape)
    return diffusion_loss.velocity_loss(apply_fn, p, x0, noise, t, jnp.zeros((batch_size, 1))).mean()

  @jax.jit
  def run(p, s, k):
    def body(carry, kk):
      p, s = carry
      loss, g = jax.value_and_grad(loss_fn)(p, kk)
      upd, s = opt.update(g, s, p)
      return (optax.apply_updates(p, upd), s), loss
    (p, s), losses = jax.lax.scan(body, (p, s), jax.random.split(k, steps))
    return p, losses[-100:].mean()

  params, loss = run(params, opt_state, key)
  return params, float(loss)


# ---------------------------------------------------------------------------------------------- task
class Toy2D(base.FamilyTask):
  """The toy task for the trainer. Conditions are a dummy zero vector (the mixture is unconditional).
  The model is the 'mlp' family (models/mlp.py), pretrained on the mixture when it is built."""

  DEFAULT_FAMILY = 'mlp'
  capabilities = frozenset({'records'})
  sample_shape = (2,)
  # Its metrics (sliced Wasserstein distances) need every sample at once: a multi-process evaluation
  # gathers the (cheap, 2-D) samples instead of averaging per-process metrics.
  eval_needs_all_samples = True

  def __init__(self, config):
    super().__init__(config)
    t = config.toy2d
    self.means = np.asarray(t.means, np.float32)
    self.std = float(t.std)
    self.weights = np.asarray(t.weights, np.float32) / np.sum(t.weights)
    self.w = np.asarray(t.reward_w, np.float32)
    self.beta = float(t.tilt_beta)
    self.tilted_means, self.tilted_weights = tilted_gmm(self.means, self.std, self.weights, self.w,
                                                        self.beta)
    self.log_partition = float(log_partition(self.means, self.std, self.weights, self.w, self.beta))

  def sample_data_n(self, key, num):
    return gmm_sample(key, num, self.means, self.std, self.weights)

  def sample_optimum(self, key, num):
    return gmm_sample(key, num, self.tilted_means, self.std, self.tilted_weights)

  def init_model(self, key):
    """(apply_fn, pretrained params). Pretraining is deterministic in the key and takes seconds."""
    t = self.config.toy2d
    apply_fn, params = self.init_untrained(key)
    params, loss = pretrain(apply_fn, params, self.sample_data_n, steps=t.pretrain_steps,
                            batch_size=t.pretrain_batch, learning_rate=t.pretrain_lr,
                            key=jax.random.fold_in(key, 1))
    self.pretrain_loss = loss
    return apply_fn, params

  def init_params_sharded(self, key, shardings):
    """The pretrained params (small) placed on `shardings` from host memory."""
    _, params = self.init_model(key)
    return parallel.place(params, shardings)

  def conditions(self, key, batch):
    del key
    return jnp.zeros((batch, 1), jnp.float32)

  def data(self, key, cond):
    """(B, 2) clean data paired with the conditions."""
    return self.sample_data_n(key, cond.shape[0])

  def from_records(self, batch, key):
    """Records of 2-D points (e.g. written by ddrl_jax.data.synthesize) -> (conditions, x0 (B, 2))."""
    del key
    x0 = np.asarray(batch['sample'], np.float32)
    if x0.shape[1:] != self.sample_shape:
      raise ValueError(f'config.data.path: records hold samples of shape {x0.shape[1:]}, the toy task '
                       f'needs {self.sample_shape}')
    return self.conditions(None, x0.shape[0]), jnp.asarray(x0)

  def prompt_set(self):
    return ['']

  def conditions_from_prompts(self, prompts, key):
    return self.conditions(key, len(prompts))

  def record_of(self, sample, prompt, text=True):
    del text
    return dict(prompt=prompt, sample=np.asarray(sample, np.float32))

  def prompts(self, cond):
    """The mixture is unconditional: every group's prompt is empty."""
    return [''] * cond.shape[0]

  def reward_inputs(self, samples, cond):
    """(M, 2) final samples -> what the reward service scores: (the points, all valid (M,)).
    The configured reward is rewards.basic.LinearReward(w = config.toy2d.reward_w)."""
    del cond
    samples = np.asarray(samples, np.float32)
    return samples, np.ones((samples.shape[0],), bool)

  def evaluate(self, samples, key, cond=None):
    """Distances of (n, 2) samples from p* and the data manifold (the mixture ignores `cond`)."""
    del cond
    samples = jnp.asarray(samples)
    ref = self.sample_optimum(key, samples.shape[0])
    data = self.sample_data_n(jax.random.fold_in(key, 2), samples.shape[0])
    return dict(
        sw_to_data=float(sliced_wasserstein(samples, data, jax.random.fold_in(key, 1))),
        reward=float(jnp.mean(samples @ self.w)),
        sw_to_optimum=float(sliced_wasserstein(samples, ref, jax.random.fold_in(key, 1))),
        off_manifold=float(off_manifold_fraction(samples, self.means, self.std)),
        optimum_reward=float(jnp.mean(ref @ self.w)))


TASK = Toy2D
