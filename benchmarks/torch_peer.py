"""The PyTorch eager peer of one DDRL iteration, on diffusers' `CosmosTransformer3DModel`.

benchmarks/step_speed.py runs it next to the JAX iteration (`python benchmarks/step_speed.py`); this module
has no main. The work is the JAX iteration's, written in plain eager PyTorch (fp32):

  rollout  (under torch.no_grad): cosmos-rl's 2AB sampler with churn on VE states, T steps of one
           network call on all M = B*N slots, plus the clean call at sigma_min (T + 1 calls), the same
           math as ddrl_jax/sampling (samplers.Sampler._batched, transitions.cosmos_2ab_mean_traced);
  update   for each trained step k: a forward + backward of the policy term (the step mean recomputed
           from the network's velocity, cosmos' unnormalized log-ratio against the rollout's mean, the
           PPO-clipped loss with z-scored group advantages) and a forward + backward of the data term
           (velocity MSE at the step's noise level t_in[k] with the rollout's noise, cosmos' weight
           t^2 + (1-t)^2, condition dropout on the text), gradients accumulated with the same scales
           (loss_scale / K, loss_scale * data_beta / K), then global-norm clipping and torch.optim.AdamW.

The random draws differ from JAX's; the network calls, their batch and the parameters do not.

Model: the diffusers 2.5 transformer at the JAX config (in_channels 16 + condition mask, padding-mask
channel, no extra positional table, no crossattn_proj when `crossattn_in` is None), qk RMSNorm eps 1e-6 as
the original Cosmos net (diffusers defaults to 1e-5; tests/test_cosmos_dit.py does the same). The timestep
goes in per frame as (M, 1, T, 1, 1) rectified-flow t in [0, 1], the output is the velocity
(tests/test_cosmos_dit.py). diffusers computes the adaLN-LoRA modulations per token where the JAX model
computes them per frame (`extra_forward_flops`).

Threads: torch.set_num_threads(os.cpu_count()) (`set_threads`): every core, as XLA's CPU client uses.
With other busy processes on the machine these threads wait on each other far longer than the work
takes (10-15x slower iterations measured on 2 cores); run the comparison on an otherwise idle machine.
"""
import math
import os
import time
import types

import numpy as np
import torch
from diffusers.models.transformers import transformer_cosmos


def set_threads(num=None):
  """torch's intra-op pool on `num` threads, by default every core of the machine; returns the count."""
  torch.set_num_threads(num or os.cpu_count())
  return torch.get_num_threads()


def _nearest_resize(img, size, interpolation=None):
  del interpolation
  return torch.nn.functional.interpolate(img, size=tuple(size), mode='nearest')


def _install_resize():
  """diffusers resizes the padding mask with torchvision, which is not installed beside this torch: a
  nearest resize through torch.nn.functional.interpolate stands in (as in tests/test_cosmos_dit.py)."""
  if not hasattr(transformer_cosmos, 'transforms'):
    transformer_cosmos.transforms = types.SimpleNamespace(
        functional=types.SimpleNamespace(resize=_nearest_resize),
        InterpolationMode=types.SimpleNamespace(NEAREST='nearest'))


def make_model(cfg, seed=0):
  """A diffusers CosmosTransformer3DModel with the shapes of `cfg` (a CosmosDiTConfig), torch's default
  init from `seed`, qk-norm eps = cfg.norm_eps. Gradient checkpointing follows cfg.remat_policy."""
  _install_resize()
  torch.manual_seed(seed)
  model = transformer_cosmos.CosmosTransformer3DModel(
      in_channels=cfg.in_channels + 1, out_channels=cfg.in_channels, num_attention_heads=cfg.num_heads,
      attention_head_dim=cfg.head_dim, num_layers=cfg.num_blocks, mlp_ratio=float(cfg.mlp_ratio),
      text_embed_dim=cfg.context_dim, adaln_lora_dim=cfg.adaln_lora_dim, max_size=(128, 240, 240),
      patch_size=tuple(cfg.patch), rope_scale=(cfg.rope_t_ratio, cfg.rope_h_ratio, cfg.rope_w_ratio),
      concat_padding_mask=cfg.concat_padding_mask, extra_pos_embed_type=None,
      use_crossattn_projection=cfg.crossattn_in is not None,
      crossattn_proj_in_channels=cfg.crossattn_in or cfg.context_dim,
      encoder_hidden_states_channels=cfg.context_dim)
  for m in model.modules():
    if m.__class__.__name__ == 'RMSNorm' and hasattr(m, 'eps'):
      m.eps = cfg.norm_eps
  set_checkpointing(model, cfg.remat_policy != 'none')
  return model


def set_checkpointing(model, on):
  if on:
    model.enable_gradient_checkpointing()
  else:
    model.disable_gradient_checkpointing()


def param_count(model):
  return sum(p.numel() for p in model.parameters())


def state_dict_numpy(model):
  """{diffusers name: numpy array}, what ddrl_jax.models.cosmos_convert reads."""
  return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def extra_forward_flops(cfg, latent):
  """FLOPs diffusers spends beyond `cosmos_dit.forward_flops` per sample forward: it runs the blocks'
  three adaLN-LoRA modulations and the final layer's on every token instead of once per frame."""
  d, r = cfg.model_channels, cfg.adaln_lora_dim
  frames = latent[0] // cfg.patch[0]
  tokens = frames * (latent[1] // cfg.patch[1]) * (latent[2] // cfg.patch[2])
  per_token = cfg.num_blocks * 3 * (d * r + r * 3 * d) + (d * r + r * 2 * d)
  return 2 * (tokens - frames) * per_token


def velocity(model, x_t, t, text):
  """x_t (M, C, T, H, W), t (M,) rectified-flow times, text (M, L, context_dim) -> v (M, C, T, H, W).

  Text-to-video: zero condition mask, zero padding mask, the same t on every frame."""
  m, _, frames, h, w = x_t.shape
  timestep = t.reshape(m, 1, 1, 1, 1).expand(m, 1, frames, 1, 1).contiguous()
  cond_mask = x_t.new_zeros(m, 1, frames, h, w)
  padding = x_t.new_zeros(1, 1, h, w)
  return model(x_t, timestep, text, condition_mask=cond_mask, padding_mask=padding, return_dict=False)[0]


def cosmos_schedule(sigmas, churn, s_noise=1.0):
  """cosmos 2AB with churn from the (T + 1,) schedule `sigmas` and churn eta: a dict of (T,) float64
  numpy arrays sigma_in = (1 + eta) sigma_i (churned), t_in = sigma_in / (1 + sigma_in), sigma_next,
  sigma_prev (the previous sigma_in; 2 sigma_in[0] at step 0, unused) and the transition std
  sigma_next sqrt(eta^2 + 2 eta) s_noise, plus the scalars sigma0, churn0 and t_min."""
  sig = np.asarray(sigmas, np.float64)
  sigma_in = (1.0 + churn) * sig[:-1]
  return dict(sigma_in=sigma_in, t_in=sigma_in / (1.0 + sigma_in), sigma_next=sig[1:],
              sigma_prev=np.concatenate([2.0 * sigma_in[:1], sigma_in[:-1]]),
              std=sig[1:] * math.sqrt(churn**2 + 2.0 * churn) * s_noise,
              sigma0=float(sig[0]), churn0=float(sig[0] * math.sqrt((1.0 + churn)**2 - 1.0) * s_noise),
              t_min=float(sig[-1] / (1.0 + sig[-1])))


def step_mean(sched, i, x_in, velocity_i, x0_prev):
  """Mean of 2AB step i (Euler at i = 0) and the x0 prediction; x_in, velocity_i, x0_prev (M, *S)."""
  t, s_in, s_next = sched['t_in'][i], sched['sigma_in'][i], sched['sigma_next'][i]
  x0 = (1.0 - t) * x_in - t * velocity_i
  if i == 0:
    ratio = s_next / s_in
    return ratio * x_in + (1.0 - ratio) * x0, x0
  h = math.log(s_in / s_next)
  phi1 = -math.expm1(-h) / h
  phi2 = (phi1 - 1.0) / (-h)
  b2 = phi2 / ((math.log(s_in) - math.log(sched['sigma_prev'][i])) / h)
  return math.exp(-h) * x_in + h * ((phi1 - b2) * x0 + b2 * x0_prev), x0


def _full(m, value, like):
  return torch.full((m,), float(value), dtype=like.dtype)


@torch.no_grad()
def rollout(model, text, sched, sample_shape, gen):
  """M rollouts of the slot conditions text (M, L, C).

  Returns a dict: x_in, x0_prev, mean, x_next (M, T, *S); noise, x0 (M, *S); nfe (network calls)."""
  m = text.shape[0]
  noise = torch.randn((m,) + tuple(sample_shape), generator=gen)
  x = sched['sigma0'] * noise + sched['churn0'] * torch.randn(noise.shape, generator=gen)
  x0_prev = torch.zeros_like(x)
  rec = {k: [] for k in ('x_in', 'x0_prev', 'mean', 'x_next')}
  num_steps = len(sched['t_in'])
  for i in range(num_steps):
    t = sched['t_in'][i]
    v = velocity(model, (1.0 - t) * x, _full(m, t, x), text)
    mean, x0 = step_mean(sched, i, x, v, x0_prev)
    x_next = mean + sched['std'][i] * torch.randn(x.shape, generator=gen)
    for k, a in zip(rec, (x, x0_prev, mean, x_next)):
      rec[k].append(a)
    x, x0_prev = x_next, x0
  t_min = sched['t_min']
  v_last = velocity(model, (1.0 - t_min) * mean, _full(m, t_min, mean), text)
  out = {k: torch.stack(v, 1) for k, v in rec.items()}
  out.update(noise=noise, x0=(1.0 - t_min) * mean - t_min * v_last, nfe=num_steps + 1)
  return out


def group_advantages(rewards, clip=5.0, eps=1e-4):
  """(B, N) rewards -> (B*N,) z-scored within each group, clamped to [-clip, clip]."""
  z = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + eps)
  return z.clamp(-clip, clip).reshape(-1)


def make_optimizer(model, optim):
  """torch AdamW with the config's learning rate, betas, eps and weight decay (config.optim)."""
  return torch.optim.AdamW(model.parameters(), lr=optim.learning_rate, betas=(optim.b1, optim.b2),
                           eps=optim.eps, weight_decay=optim.weight_decay)


def update(model, optimizer, traj, advantages, data_x0, text, sched, steps, rl, grad_clip, gen):
  """One DDRL update: per trained step the policy and data terms' forward + backward, then AdamW.

  traj: `rollout`'s dict; advantages (M,); data_x0 (M, *S) each group's clean sample repeated for its
  N slots; text (M, L, C); steps: the trained step indices; rl: config.rl (clip_range, loss_scale,
  data_beta, cond_dropout). Returns the losses and the seconds of each part."""
  optimizer.zero_grad(set_to_none=True)
  m, num_k = text.shape[0], len(steps)
  pg_total = data_total = 0.0
  seconds = dict(policy=0.0, data=0.0)
  target = traj['noise'] - data_x0
  for k in steps:
    t0 = time.perf_counter()
    x_in, t = traj['x_in'][:, k], sched['t_in'][k]
    v = velocity(model, (1.0 - t) * x_in, _full(m, t, x_in), text)
    mean, _ = step_mean(sched, k, x_in, v, traj['x0_prev'][:, k])
    x_next, mean_old = traj['x_next'][:, k], traj['mean'][:, k]
    log_ratio = -((x_next - mean)**2 - (x_next - mean_old)**2).reshape(m, -1).mean(1)
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1.0 - rl.clip_range, 1.0 + rl.clip_range)
    pg = torch.maximum(-advantages * ratio, -advantages * clipped).mean()
    (rl.loss_scale / num_k * pg).backward()
    t1 = time.perf_counter()
    keep = (torch.rand(m, generator=gen) >= rl.cond_dropout).to(text.dtype)
    x_t = (1.0 - t) * data_x0 + t * traj['noise']
    v = velocity(model, x_t, _full(m, t, x_t), text * keep[:, None, None])
    mse = ((v - target)**2).reshape(m, -1).mean(1)
    data = ((t**2 + (1.0 - t)**2) * mse).mean()
    (rl.loss_scale * rl.data_beta / num_k * data).backward()
    seconds['policy'] += t1 - t0
    seconds['data'] += time.perf_counter() - t1
    pg_total += float(pg.detach()) / num_k
    data_total += float(data.detach()) / num_k
  t0 = time.perf_counter()
  torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
  optimizer.step()
  seconds['adamw'] = time.perf_counter() - t0
  return dict(pg_loss=pg_total, data_loss=data_total,
              loss=rl.loss_scale * (pg_total + rl.data_beta * data_total), seconds=seconds)


def make_inputs(cfg, latent, text_tokens, groups, rollouts, seed=0):
  """Random slot conditions text (M, L, C), data x0 (M, *S) (one sample per group, repeated N times) and
  rewards (B, N), M = B*N."""
  gen = torch.Generator().manual_seed(seed)
  m = groups * rollouts
  text = torch.randn((groups, text_tokens, cfg.context_dim), generator=gen).repeat_interleave(rollouts, 0)
  x0 = torch.randn((groups, cfg.in_channels) + tuple(latent), generator=gen).repeat_interleave(rollouts, 0)
  rewards = torch.randn((groups, rollouts), generator=gen)
  assert text.shape[0] == m
  return text, x0, rewards


def run_iteration(model, config, sampler, cfg, latent, text_tokens, runs, seed=0):
  """Times the eager iteration: one warm-up, then `runs` runs (each: rollout, update).

  Returns dict with per-run lists rollout_s, policy_s, data_s, adamw_s, update_s, iteration_s and
  cpu_per_wall (process CPU seconds per second) (warm-up excluded), warmup_s, the last losses, nfe, and
  param_change (max |delta| of the parameters over all runs: the update really changes them)."""
  gen = torch.Generator().manual_seed(seed + 1)
  text, x0, rewards = make_inputs(cfg, latent, text_tokens, config.batch_size, config.num_rollouts, seed)
  sched = cosmos_schedule(sampler.sigmas, sampler.noise, sampler.s_noise)
  steps = [int(s) for s in config.rl.train_steps]
  optimizer = make_optimizer(model, config.optim)
  advantages = group_advantages(rewards)
  sample_shape = (cfg.in_channels,) + tuple(latent)
  before = [p.detach().clone() for p in model.parameters()]
  times = {k: [] for k in ('rollout_s', 'policy_s', 'data_s', 'adamw_s', 'update_s', 'iteration_s',
                           'cpu_per_wall')}
  out = {}
  for run in range(runs + 1):
    t0, c0 = time.perf_counter(), time.process_time()
    traj = rollout(model, text, sched, sample_shape, gen)
    t1 = time.perf_counter()
    losses = update(model, optimizer, traj, advantages, x0, text, sched, steps, config.rl,
                    config.optim.grad_clip, gen)
    t2 = time.perf_counter()
    if run == 0:
      out['warmup_s'] = t2 - t0
      continue
    sec = losses.pop('seconds')
    for k, v in (('rollout_s', t1 - t0), ('policy_s', sec['policy']), ('data_s', sec['data']),
                 ('adamw_s', sec['adamw']), ('update_s', t2 - t1), ('iteration_s', t2 - t0),
                 ('cpu_per_wall', (time.process_time() - c0) / (t2 - t0))):
      times[k].append(v)
    out.update(losses)
  change = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before))
  out.update(times, nfe=traj['nfe'], param_change=change,
             x0_finite=bool(torch.isfinite(traj['x0']).all()))
  return out


def time_dit(model, batch, latent, text_tokens, runs, checkpointing=False, seed=0):
  """The network alone at `batch`: per-run seconds of a no-grad forward and of a forward + backward of
  mean(v^2) (gradient checkpointing on or off). Returns (forward_s, forward_backward_s) lists."""
  gen = torch.Generator().manual_seed(seed)
  cfg = model.config
  x = torch.randn((batch, cfg.out_channels) + tuple(latent), generator=gen)
  t = torch.rand(batch, generator=gen)
  text = torch.randn((batch, text_tokens, cfg.text_embed_dim), generator=gen)
  previous = model.is_gradient_checkpointing
  set_checkpointing(model, checkpointing)

  def forward():
    with torch.no_grad():
      velocity(model, x, t, text)

  def forward_backward():
    model.zero_grad(set_to_none=True)
    (velocity(model, x, t, text)**2).mean().backward()

  result = []
  for fn in (forward, forward_backward):
    fn()
    times = []
    for _ in range(runs):
      t0 = time.perf_counter()
      fn()
      times.append(time.perf_counter() - t0)
    result.append(times)
  set_checkpointing(model, previous)
  return tuple(result)


def matmul_peak(sizes=(512, 1024, 2048), runs=3):
  """{n: best GFLOP/s of an fp32 (n, n) x (n, n) torch matmul} (2 n^3 FLOPs)."""
  out = {}
  for n in sizes:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_seconds(lambda: a @ b) for _ in range(runs))
    out[n] = 2.0 * n**3 / best / 1e9
  return out


def _seconds(fn):
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0
