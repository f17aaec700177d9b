"""Model FLOPs of an iteration (ddrl_jax/flops.py) against independent counts, the peak table, and the
trainer's flops_per_iteration / achieved_flops_per_s / mfu metrics.

Independent counts: (1) the network forwards that the rollout, data gradient and update really trace,
counted by wrapping apply_fn (per traced call: its batch x the lengths of the enclosing lax.scans, x3
under a gradient); (2) XLA's compiled.cost_analysis()['flops'] of the forwards. XLA counts a scan or
while body once, whatever its trip count; the tests check that and compare per body."""
import math
import types

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import ocr_tiny
from ddrl_jax import flops
from ddrl_jax import metrics as metrics_lib
from ddrl_jax import optim
from ddrl_jax import trainer as trainer_lib
from ddrl_jax import update as update_lib
from ddrl_jax.models.cosmos import dit as cosmos_dit
from ddrl_jax.parallel import topology
from ddrl_jax.tasks import ocr
from ddrl_jax.tasks import toy2d
from test_trainer import small_config


def xla_flops(fn, *args):
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost['flops'])


def zeros_like_abstract(tree):
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


# ------------------------------------------------------------------------------------- peak table
@pytest.mark.parametrize('kind,dtype,peak', [
    ('TPU v5', 'bfloat16', 459e12),            # v5p as JAX names it
    ('TPU v5p', 'bfloat16', 459e12),
    ('TPU v5 lite', 'bfloat16', 197e12),       # v5e
    ('TPU v5e', 'bf16', 197e12),
    ('TPU v6 lite', 'bfloat16', 918e12),       # v6e / Trillium
    ('TPU v4', 'bfloat16', 275e12),
    ('NVIDIA H100 80GB HBM3', 'bfloat16', 989e12),
    ('NVIDIA H100 80GB HBM3', 'tf32', 494.5e12),
    ('NVIDIA H100 PCIe', 'bfloat16', 756e12),
    ('NVIDIA H200', 'bfloat16', 989e12),
    ('NVIDIA H200', jnp.bfloat16, 989e12),
    ('NVIDIA A100-SXM4-80GB', 'bfloat16', 312e12),
    ('NVIDIA A100-SXM4-40GB', 'float32', 19.5e12),
    ('NVIDIA A100 80GB PCIe', 'tf32', 156e12),
    ('NVIDIA A100-SXM4-80GB', np.float16, 312e12),
])
def test_peak_flops_by_device_kind(kind, dtype, peak):
  assert flops.peak_flops(kind, dtype) == peak


@pytest.mark.parametrize('kind,dtype', [
    ('cpu', 'float32'), ('cpu', 'bfloat16'), ('TPU v4 lite', 'bfloat16'), ('TPU v5', 'float32'),
    ('NVIDIA H100 NVL', 'bfloat16'), ('NVIDIA GeForce RTX 4090', 'bfloat16'), ('', 'bfloat16'),
])
def test_peak_flops_unknown_is_none(kind, dtype):
  assert flops.peak_flops(kind, dtype) is None


def test_peak_flops_bad_dtype_names_it():
  with pytest.raises(ValueError, match='int8'):
    flops.peak_flops('NVIDIA H200', 'int8')


def test_tpu_peaks_agree_with_the_topology_table():
  kinds = {'v5p': 'TPU v5', 'v4': 'TPU v4', 'v5e': 'TPU v5 lite', 'v6e': 'TPU v6 lite'}
  for name, spec in topology.TOPOLOGIES.items():
    assert flops.peak_flops(kinds[name.split('-')[0]], 'bfloat16') == spec.peak_bf16_flops, name


def test_float32_matmuls_count_at_the_precision_they_run():
  assert flops.matmul_dtype('bfloat16', 'gpu') == 'bfloat16'
  assert flops.matmul_dtype('float32', 'gpu') == 'tf32'             # default precision: TF32
  assert flops.matmul_dtype('float32', 'tpu') == 'bfloat16'         # default precision: one bf16 pass
  assert flops.matmul_dtype('float32', 'gpu', 'highest') == 'float32'
  assert flops.matmul_dtype('float32', 'tpu', 'float32') == 'float32'
  assert flops.matmul_dtype('float32', 'cpu') == 'float32'
  assert flops.matmul_dtype('float32', 'gpu', 'BF16_BF16_F32') == 'bfloat16'
  assert flops.matmul_dtype('float32', 'gpu', 'tensorfloat32') == 'tf32'
  assert flops.matmul_dtype('float32', 'tpu', 'highest') == 'float32'


def test_devices_peak_sums_chips_and_is_none_on_cpu():
  chips = [types.SimpleNamespace(device_kind='NVIDIA H200', platform='gpu')] * 4
  assert flops.devices_peak_flops(chips, 'bfloat16') == 4 * 989e12
  assert flops.devices_peak_flops(chips, 'float32') == 4 * 494.5e12
  assert flops.devices_peak_flops(jax.devices()[:2], 'float32') is None
  with pytest.raises(ValueError):
    flops.devices_peak_flops([], 'float32')


def test_throughput_metrics():
  assert flops.throughput_metrics(1e12, 2.0) == {'achieved_flops_per_s': 5e11}
  assert flops.throughput_metrics(1e12, 2.0, peak=1e12) == {'achieved_flops_per_s': 5e11, 'mfu': 0.5}
  assert flops.throughput_metrics(1e12, 0.0) == {}
  with pytest.raises(ValueError, match='forward_flops_per_sample'):
    flops.iteration_flops(small_config('ddrl'), 0.0)


# --------------------------------------------------------------------------- formula per algorithm
# small_config: T = 6 steps. Trained steps: ddrl's default even steps (0, 2, 4); ddrl_exact all 6;
# flow_grpo floor(0.99 T) = 5; dance_grpo / ddpo draw int(5 * fraction) of T - 1 = 5 per rollout.
@pytest.mark.parametrize('preset,overrides,passes', [
    ('ddrl', {}, (7, 9, 0, 9)),                              # cosmos_2ab: 6 + 1 calls; data 'full'
    ('ddrl_reduced', {}, (7, 9, 0, 3)),
    ('ddrl', {'rl.data_beta': 0.0}, (7, 9, 0, 0)),
    ('ddrl_exact', {}, (6, 18, 0, 18)),                      # flow_sde
    ('flow_grpo', {}, (6, 15, 5, 0)),                        # kl_beta 0.04: the reference forward
    ('flow_grpo', {'rl.kl_beta': 0.0}, (6, 15, 0, 0)),
    ('dance_grpo', {}, (6, 9, 0, 0)),                        # fraction 0.6: 3 steps
    ('ddpo', {}, (6, 15, 0, 0)),                             # fraction 1: 5 steps
    ('diffusion_nft', {}, (6, 15, 10, 0)),                   # int(0.99 * 6) = 5 times; old + reference
    ('diffusion_nft', {'rl.kl_beta': 0.0}, (6, 15, 5, 0)),   # the old policy's forward alone
])
def test_iteration_passes_per_algorithm(preset, overrides, passes):
  c = small_config(preset, **overrides)
  assert tuple(flops.iteration_passes(c)) == passes
  f = flops.iteration_flops(c, 100.0)
  assert f.total == pytest.approx(sum(passes) * c.batch_size * c.num_rollouts * 100.0)


class PassCounter:
  """apply_fn wrapped to count, while the functions of an iteration are traced, the forwards of one
  sample each call makes when run: its batch x the lengths of the enclosing lax.scans, x3 when traced
  under a gradient (forward + backward)."""

  def __init__(self, apply_fn):
    self.apply_fn = apply_fn
    self.scans = []
    self.passes = 0

  def patched_scan(self, real_scan):
    def scan(f, init, xs=None, length=None, **kw):
      n = length if length is not None else jax.tree.leaves(xs)[0].shape[0]

      def body(carry, x):
        self.scans.append(n)
        try:
          return f(carry, x)
        finally:
          self.scans.pop()

      return real_scan(body, init, xs, length=length, **kw)
    return scan

  def __call__(self, params, x_t, t, cond):
    under_grad = any(type(a).__name__ in ('JVPTracer', 'LinearizeTracer') for a in jax.tree.leaves(params))
    self.passes += x_t.shape[0] * math.prod(self.scans) * (3 if under_grad else 1)
    return self.apply_fn(params, x_t, t, cond)


def traced_passes(config, monkeypatch):
  """Forwards of one sample per rollout slot that the rollout, data gradient and update trace (dict)."""
  task = toy2d.Toy2D(config)
  apply_fn, abstract = task.abstract_params(jax.random.key(0))
  counter = PassCounter(apply_fn)
  monkeypatch.setattr(jax.lax, 'scan', counter.patched_scan(jax.lax.scan))
  sampler = update_lib.make_sampler(config)
  optimizer = optim.make_optimizer(config.optim)
  b, n = config.batch_size, config.num_rollouts
  slots = b * n
  key = jax.random.key(0)
  slot_cond = jnp.zeros((slots, 1))
  out = {}
  traj = jax.eval_shape(lambda p: sampler.rollout(counter, p, slot_cond, key, num_rollouts=1,
                                                  sample_shape=task.sample_shape), abstract)
  out['rollout'] = counter.passes
  rollout = update_lib.RolloutBatch(traj=zeros_like_abstract(traj), rewards=jnp.zeros((slots, 1)),
                                    cond=slot_cond)
  data = update_lib.DataBatch(x0=jnp.zeros((b, 2)), cond=jnp.zeros((b, 1)))
  data_grads, update = update_lib.make_update_fns(counter, sampler, config, optimizer)
  counter.passes = 0
  grads = jax.eval_shape(data_grads, abstract, rollout, data, key)[0]
  out['data'] = counter.passes
  state = jax.eval_shape(lambda p: update_lib.init_train_state(p, config, optimizer), abstract)
  counter.passes = 0
  jax.eval_shape(update, state, rollout, grads, key)
  out['update'] = counter.passes
  return {k: v / slots for k, v in out.items()}


@pytest.mark.parametrize('preset,overrides', [
    ('ddrl', {}), ('ddrl_reduced', {}), ('ddrl_exact', {}), ('flow_grpo', {}),
    ('flow_grpo', {'rl.kl_beta': 0.0}), ('dance_grpo', {}), ('ddpo', {}), ('diffusion_nft', {}),
    ('ddrl', {'rl.train_steps': (0, 1, 3), 'sampler.kind': 'flow_sde'}),
])
def test_iteration_passes_equal_the_traced_network_calls(preset, overrides, monkeypatch):
  c = small_config(preset, **overrides)
  got = traced_passes(c, monkeypatch)
  want = flops.iteration_passes(c)
  assert got == {'rollout': want.rollout, 'data': want.data, 'update': want.policy + want.reference}


def test_sampler_nfe_is_the_trajectory_nfe():
  for preset in ('ddrl', 'flow_grpo', 'ddpo'):
    c = small_config(preset)
    task = toy2d.Toy2D(c)
    apply_fn, abstract = task.abstract_params(jax.random.key(0))
    traj = update_lib.make_sampler(c).rollout(apply_fn, zeros_like_abstract(abstract), jnp.zeros((2, 1)),
                                              jax.random.key(0), num_rollouts=2, sample_shape=(2,))
    np.testing.assert_array_equal(traj.nfe, flops.sampler_nfe(c))


# ------------------------------------------------------------------------------------ XLA's count
def test_toy2d_forward_and_data_gradient_match_xla():
  """The MLP's analytic forward within 3% of XLA's (which adds the elementwise ops); the reduced data
  term (one gradient, no scan) costs 3 forwards; XLA counts the rollout's step scan once."""
  c = small_config('ddrl_reduced')
  c.toy2d.width, c.toy2d.depth = 256, 3
  task = toy2d.Toy2D(c)
  apply_fn, abstract = task.abstract_params(jax.random.key(0))
  params = zeros_like_abstract(abstract)
  per_sample = task.forward_flops_per_sample()
  assert per_sample == 2 * (35 * 256 + 256 * 256 * 2 + 256 * 2)
  b = 16
  fwd = xla_flops(apply_fn, params, jnp.zeros((b, 2)), jnp.zeros((b,)), jnp.zeros((b, 1)))
  assert fwd / (b * per_sample) == pytest.approx(1.0, abs=0.03)

  sampler = update_lib.make_sampler(c)
  bb, n = c.batch_size, c.num_rollouts
  slots = bb * n
  cond = jnp.zeros((bb, 1))
  roll = lambda p, k: sampler.rollout(apply_fn, p, cond, k, num_rollouts=n, sample_shape=(2,))
  key = jax.random.key(0)
  # cosmos_2ab: the step scan's body (one call) + the final clean call, not nfe = 7 calls.
  assert xla_flops(roll, params, key) / (slots * per_sample) == pytest.approx(2.0, abs=0.1)

  traj = roll(params, key)
  rollout = update_lib.flat_rollout_batch(traj, jnp.zeros((bb, n)), cond)
  data = update_lib.DataBatch(x0=jnp.zeros((bb, 2)), cond=cond)
  data_grads, _ = update_lib.make_update_fns(apply_fn, sampler, c, optim.make_optimizer(c.optim))
  assert flops.iteration_passes(c).data == 3
  got = xla_flops(data_grads, params, rollout, data, key) / (slots * per_sample)
  assert got == pytest.approx(3.0, abs=0.1)


def _dit_forward(cfg, latent, text_tokens, batch=2):
  """(XLA FLOPs of one DiT forward of `batch` samples, analytic FLOPs per sample)."""
  model = nnx.eval_shape(lambda: cosmos_dit.CosmosDiT(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  fn = lambda s, x, t, ctx: nnx.merge(graphdef, s)(x, t, ctx)
  x = jnp.zeros((batch, cfg.in_channels) + latent)
  t = jnp.zeros((batch, latent[0]))
  ctx = jnp.zeros((batch, text_tokens, cfg.crossattn_in))
  _, parts = cosmos_dit.forward_flops(cfg, latent=latent, text_tokens=text_tokens)
  return xla_flops(fn, zeros_like_abstract(state), x, t, ctx), float(sum(parts.values()))


def test_cosmos_forward_flops_match_xla_per_block():
  """One block: the analytic count within 6% of XLA's (norms, RoPE, softmax, GELU are extra there).
  More blocks: XLA counts the block scan's body once (so its count does not grow with depth)."""
  cfg = lambda nb: cosmos_dit.tiny(model_channels=256, num_blocks=nb, num_heads=2, adaln_lora_dim=32,
                                   crossattn_in=64, context_dim=128)
  latent, text, batch = (2, 16, 16), 16, 2
  xla_1, analytic_1 = _dit_forward(cfg(1), latent, text, batch)
  assert xla_1 / (batch * analytic_1) == pytest.approx(1.0, abs=0.06)
  xla_3, analytic_3 = _dit_forward(cfg(3), latent, text, batch)
  assert xla_3 == pytest.approx(xla_1, rel=0.01)
  assert analytic_3 > 2.5 * analytic_1


def test_ocr_forward_flops_and_guidance_match_xla():
  """The OCR task's apply_fn (one-frame DiT on pixels): its count against XLA's, and classifier-free
  guidance (one forward of 2B) counted twice."""
  counts = {}
  for guidance in (1.0, 2.0):
    c = ocr_tiny.get_config()
    c.ocr.depth, c.ocr.guidance, c.ocr.width = 1, guidance, 256
    task = ocr.OCRTask(c)
    apply_fn, abstract = task.abstract_params(jax.random.key(0))
    b = 2
    args = (zeros_like_abstract(abstract), jnp.zeros((b,) + task.sample_shape), jnp.full((b,), 0.5),
            jnp.ones((b, c.ocr.text_length), jnp.int32))
    counts[guidance] = (xla_flops(apply_fn, *args) / b, task.forward_flops_per_sample())
  assert counts[2.0][1] == 2 * counts[1.0][1]
  for xla, analytic in counts.values():
    assert xla / analytic == pytest.approx(1.0, abs=0.1)


# ---------------------------------------------------------------------------------------- trainer
def test_trainer_logs_flops_and_throughput_without_mfu_on_cpu(tmp_path):
  c = small_config('ddrl', num_iterations=3)
  c.checkpoint_every = 3
  trainer = trainer_lib.Trainer(c, tmp_path, devices=jax.devices()[:1])
  trainer.train(progress=False)
  rows = {r['step']: r for r in metrics_lib.read_metrics(tmp_path) if 'loss' in r}
  assert sorted(rows) == [1, 2, 3]
  want = flops.iteration_flops(c, toy2d.Toy2D(c).forward_flops_per_sample()).total
  # Counted here: per slot 7 rollout calls (T = 6 + cosmos_2ab's clean call), 3 x 3 for the policy's
  # trained steps (0, 2, 4) and 3 x 3 for the data term; 8 x 4 slots; 2 x the MACs of the width-32,
  # depth-2 MLP (in 35 features, one hidden 32 x 32 layer, out 2).
  assert (c.batch_size, c.num_rollouts, c.toy2d.width, c.toy2d.depth) == (8, 4, 32, 2)
  counted = (7 + 9 + 9) * 8 * 4 * 2 * (35 * 32 + 32 * 32 + 32 * 2)
  for step, r in rows.items():
    assert r['flops_per_iteration'] == pytest.approx(want)
    assert r['flops_per_iteration'] == pytest.approx(counted, rel=1e-12)
    assert 'mfu' not in r
    assert r['time_compute'] > 0 and r['time_rollout'] > 0
    # The first iteration compiles the step functions: no throughput for it.
    assert ('achieved_flops_per_s' in r) == (step > 1)
  for step in (2, 3):
    r = rows[step]
    assert r['achieved_flops_per_s'] == pytest.approx(want / r['time_compute'])
  assert trainer.peak_flops is None


def test_progress_bar_fields():
  assert trainer_lib._throughput_postfix({'loss': 1.0}) == {}
  assert trainer_lib._throughput_postfix({'achieved_flops_per_s': 2.5e12, 'mfu': 0.4123}) == {
      'GFLOP/s': '2500', 'mfu': '41.2%'}
