"""Rewards on decoded samples and the asynchronous service that scores them (no JAX imports here:
reward workers and servers start without it)."""
from ddrl_jax.rewards.pool import errors_by_kind
from ddrl_jax.rewards.pool import FAILURE_KINDS
from ddrl_jax.rewards.pool import InlinePool
from ddrl_jax.rewards.pool import RewardJob
from ddrl_jax.rewards.pool import RewardResult
from ddrl_jax.rewards.pool import RewardServiceError
from ddrl_jax.rewards.pool import WorkerPool
from ddrl_jax.rewards.registry import known_rewards
from ddrl_jax.rewards.registry import make_reward
from ddrl_jax.rewards.registry import register
from ddrl_jax.rewards.service import COMBINE_MODES
from ddrl_jax.rewards.service import LocalRewardService
from ddrl_jax.rewards.service import make_reward_service
from ddrl_jax.rewards.service import RewardSpec
from ddrl_jax.rewards.service import ScoredElsewhere
