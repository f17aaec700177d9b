#!/usr/bin/env bash
# shellcheck disable=SC2153
# (SC2153: the R_* variables come from launch/render.py through eval.)
# DDRL training on a Cloud TPU v5p slice with plain gcloud (no cluster): create the slice (queued
# resource or direct create), ship and install this repository on every host, run ddrl_jax.train on
# all hosts at once (`tpu-vm ssh --worker=all`). jax.distributed finds the other hosts by itself.
# Untested against real Cloud TPU here: `--dry-run` prints the commands and runs none.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu/gcloud_v5p.sh --zone=ZONE --workdir=gs://BUCKET/DIR [options] [-- TRAIN_FLAGS...]

Creates a TPU v5p slice sized to the config's mesh and runs on every host:
  ~/ddrl_venv/bin/python -m ddrl_jax.train --config=CONFIG --workdir=WORKDIR --compilation_cache_dir=WORKDIR/xla_cache TRAIN_FLAGS
with LIBTPU_INIT_ARGS set to the collective/compute-overlap preset (maxdiffusion's v5p list).

Options (--opt=value or --opt value):
  --config=PATH[:ARG]     config file, relative to the repository (default: configs/cosmos2b.py)
  --name=NAME             TPU / queued-resource name (default: ddrl-<config name>)
  --zone=ZONE             GCE zone with v5p capacity, e.g. us-east5-a (required)
  --project=PROJECT       GCP project (default: gcloud's configured project)
  --accelerator=TYPE      slice type (default: from the mesh: 256 chips -> v5p-512, 1024 -> v5p-2048);
                          must have as many chips as the mesh has devices
  --runtime-version=V     TPU VM image (default: v2-alpha-tpuv5)
  --workdir=gs://...      checkpoints, metrics, XLA cache: a GCS path every host reaches (required)
  --repo=PATH|GIT_URL     what to install in ~/ddrl_jax on every host (replacing what is there): a
                          local checkout (default: this one; its files minus .git, checkpoints/ and
                          workdir*/ are copied) or a git URL (cloned, or pulled on later runs)
  --queued                request a queued resource and wait until it is ACTIVE (default: tpu-vm create)
  --capacity=KIND         on-demand (default), reserved (your reservation; --reserved), spot (--spot,
                          preemptible) or best-effort (`gcloud alpha`'s --best-effort); all but
                          on-demand imply --queued. Most projects have no on-demand v5p quota: a request
                          on it can wait in the queue indefinitely
  --valid-until-duration=D  give up a queued request not filled within D (e.g. 6h; gcloud's flag)
  --skip-create           use an existing slice NAME (its accelerator type is checked first)
  --skip-install          do not copy/install the repository (already done on the hosts)
  --remote-python=PY      the hosts' Python for ~/ddrl_venv, from the deadsnakes PPA (default:
                          python3.11; jax 0.10.2 needs >= 3.11, the v2-alpha-tpuv5 image has 3.10 and
                          Ubuntu 22.04's own python3.11 is an early 3.11.0); see launch/tpu/host_setup.sh
  --ssh-parallel=N        hosts installed at once (default: 32); the hosts that fail are named
  --libtpu-init-args=STR  replace the LIBTPU_INIT_ARGS preset
  --poll-seconds=N        queued-resource poll interval (default: 60)
  --dry-run               print every command (lines starting with '+ '), run nothing
  -h, --help              this text
Everything after `--` is passed to ddrl_jax.train (e.g. -- --config.num_iterations=2). With
-- --config.reward.backend=redis --config.reward.redis_url=URL (a reward pool elsewhere, e.g.
launch/tpu/gcloud_reward_pool.sh) the pool's bearer token, $DDRL_REWARD_TOKEN here (required then), is
copied to every host (~/.ddrl_reward_token, by scp, never on a command line) and exported for the trainer.
Needs: gcloud (authenticated), and python3 with this repository's requirements on the launching
machine (launch/render.py reads the config's mesh).
EOF
}

die() { echo "gcloud_v5p.sh: error: $*" >&2; echo "(run with --help for usage)" >&2; exit 2; }
fail() { echo "gcloud_v5p.sh: error: $*" >&2; exit 1; }
q() {   # one word shell-quoted like Python's shlex.quote
  if [[ -n $1 && $1 =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then printf '%s' "$1"
  else printf "'%s'" "${1//\'/\'\"\'\"\'}"; fi
}
show() { local out='+' a; for a in "$@"; do out+=" $(q "$a")"; done; printf '%s\n' "$out"; }
run() { show "$@"; if ((DRY_RUN)); then return 0; fi; "$@"; }
take() {   # take "$@": VAL = the option's value, SHIFT = words used
  if [[ $1 == *=* ]]; then VAL=${1#*=}; SHIFT=1
  else (($# >= 2)) || die "option $1 needs a value"; VAL=$2; SHIFT=2; fi
}

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python3}
# maxdiffusion README (Wan 2.1 training on v5p): async collective fusion, all-gather / all-to-all
# (Ulysses context parallelism) overlap, data-parallel all-reduce opt, the latency-hiding scheduler;
# plus --xla_tpu_enable_latency_hiding_scheduler. Every flag is known to libtpu 0.0.42
# (tests/test_launch.py checks that where libtpu is installed).
LIBTPU_PRESET="--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true \
--xla_tpu_megacore_fusion_allow_ags=false \
--xla_enable_async_collective_permute=true \
--xla_tpu_enable_ag_backward_pipelining=true \
--xla_tpu_enable_data_parallel_all_reduce_opt=true \
--xla_tpu_data_parallel_opt_different_sized_ops=true \
--xla_tpu_enable_async_collective_fusion=true \
--xla_tpu_enable_async_collective_fusion_multiple_steps=true \
--xla_tpu_overlap_compute_collective_tc=true \
--xla_enable_async_all_gather=true \
--xla_tpu_scoped_vmem_limit_kib=65536 \
--xla_tpu_enable_async_all_to_all=true \
--xla_tpu_enable_all_experimental_scheduler_features=true \
--xla_tpu_enable_scheduler_memory_pressure_tracking=true \
--xla_tpu_host_transfer_overlap_limit=24 \
--xla_tpu_aggressive_opt_barrier_removal=ENABLED \
--xla_lhs_prioritize_async_depth_over_stall=ENABLED \
--xla_should_allow_loop_variant_parameter_in_chain=ENABLED \
--xla_should_add_loop_invariant_op_in_chain=ENABLED \
--xla_max_concurrent_host_send_recv=100 \
--xla_tpu_scheduler_percent_shared_memory_limit=100 \
--xla_latency_hiding_scheduler_rerun=2 \
--xla_tpu_use_minor_sharding_for_major_trivial_input=true \
--xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1 \
--xla_tpu_assign_all_reduce_scatter_layout=true \
--xla_tpu_enable_latency_hiding_scheduler=true"

CONFIG=configs/cosmos2b.py NAME='' ZONE='' PROJECT='' ACCELERATOR='' RUNTIME=v2-alpha-tpuv5
WORKDIR='' REPO=$REPO_ROOT QUEUED=0 SKIP_CREATE=0 SKIP_INSTALL=0 DRY_RUN=0 POLL=60 RPY=python3.11
CAPACITY=on-demand VALID_UNTIL='' PARALLEL=32
LIBTPU=$LIBTPU_PRESET
EXTRA=()
while (($#)); do
  SHIFT=1
  case $1 in
    -h|--help) usage; exit 0 ;;
    --config|--config=*) take "$@"; CONFIG=$VAL ;;
    --name|--name=*) take "$@"; NAME=$VAL ;;
    --zone|--zone=*) take "$@"; ZONE=$VAL ;;
    --project|--project=*) take "$@"; PROJECT=$VAL ;;
    --accelerator|--accelerator=*) take "$@"; ACCELERATOR=$VAL ;;
    --runtime-version|--runtime-version=*) take "$@"; RUNTIME=$VAL ;;
    --workdir|--workdir=*) take "$@"; WORKDIR=$VAL ;;
    --repo|--repo=*) take "$@"; REPO=$VAL ;;
    --libtpu-init-args|--libtpu-init-args=*) take "$@"; LIBTPU=$VAL ;;
    --poll-seconds|--poll-seconds=*) take "$@"; POLL=$VAL ;;
    --remote-python|--remote-python=*) take "$@"; RPY=$VAL ;;
    --capacity|--capacity=*) take "$@"; CAPACITY=$VAL ;;
    --valid-until-duration|--valid-until-duration=*) take "$@"; VALID_UNTIL=$VAL ;;
    --ssh-parallel|--ssh-parallel=*) take "$@"; PARALLEL=$VAL ;;
    --queued) QUEUED=1 ;;
    --skip-create) SKIP_CREATE=1 ;;
    --skip-install) SKIP_INSTALL=1 ;;
    --dry-run) DRY_RUN=1 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown option: $1" ;;
  esac
  shift "$SHIFT"
done
[[ -n $ZONE ]] || die "--zone is required"
[[ $WORKDIR == gs://?* ]] || die "--workdir must be a gs:// path every host can reach (got '${WORKDIR}')"
[[ $POLL =~ ^[0-9]+$ ]] || die "--poll-seconds must be a number"
[[ $RPY =~ ^python3\.[0-9]+$ ]] || die "--remote-python must be an apt package name like python3.11"
[[ $PARALLEL =~ ^[1-9][0-9]*$ ]] || die "--ssh-parallel must be a positive number"
QR=(gcloud compute tpus queued-resources create)     # the request, by capacity kind
case $CAPACITY in
  on-demand) QR_FLAGS=() ;;
  reserved) QR_FLAGS=(--reserved) ;;
  spot) QR_FLAGS=(--spot) ;;
  best-effort) QR_FLAGS=(--best-effort); QR=(gcloud alpha compute tpus queued-resources create) ;;
  *) die "--capacity must be on-demand, reserved, spot or best-effort (got '$CAPACITY')" ;;
esac
if [[ $CAPACITY != on-demand || -n $VALID_UNTIL ]]; then
  ((SKIP_CREATE)) && die "--capacity / --valid-until-duration ask for a new slice; drop --skip-create"
  QUEUED=1                                          # only queued resources take these
fi
[[ -z $VALID_UNTIL ]] || QR_FLAGS+=(--valid-until-duration="$VALID_UNTIL")
WORKDIR=${WORKDIR%/}
REDIS_REWARDS=0     # the train flags ask for the Redis reward backend: the hosts need the bearer token
for ((i = 0; i < ${#EXTRA[@]}; i++)); do
  case ${EXTRA[i]} in
    --config.reward.backend=redis) REDIS_REWARDS=1 ;;
    --config.reward.backend) [[ ${EXTRA[i + 1]:-} == redis ]] && REDIS_REWARDS=1 ;;
  esac
done
if ((REDIS_REWARDS)) && [[ -z ${DDRL_REWARD_TOKEN:-} ]]; then
  die "--config.reward.backend=redis needs DDRL_REWARD_TOKEN: export the reward servers' bearer token (the value given to launch/tpu/gcloud_reward_pool.sh or launch/gpu/reward_pool.sbatch)"
fi

# Devices of the mesh -> slice (launch/render.py; exits 2 naming what does not fit).
RENDER_ARGS=(--config="$CONFIG" --require=tpu)
[[ -n $ACCELERATOR ]] && RENDER_ARGS+=(--accelerator="$ACCELERATOR")
RENDERED=$("$PYTHON" "$REPO_ROOT/launch/render.py" "${RENDER_ARGS[@]}" --format=shell -- ${EXTRA[@]+"${EXTRA[@]}"}) \
  || die "the config's mesh does not fit (see above)"
eval "$RENDERED"
ACCELERATOR=$R_ACCELERATOR
NAME=${NAME:-ddrl-$R_NAME}
[[ $NAME =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || die "--name '$NAME': lowercase letters, digits and '-'"
echo "# $R_CONFIG: mesh $R_MESH_DESC = $R_DEVICES devices -> $ACCELERATOR ($R_CHIPS chips, $R_TPU_HOSTS hosts)" >&2

GC=(--zone "$ZONE")
[[ -n $PROJECT ]] && GC+=(--project "$PROJECT")
ssh_all() { run gcloud compute tpus tpu-vm ssh "$NAME" "${GC[@]}" --worker=all --command "$1"; }

# 1. The slice.
if ((SKIP_CREATE)); then
  show gcloud compute tpus tpu-vm describe "$NAME" "${GC[@]}" --format='value(acceleratorType)'
  if ! ((DRY_RUN)); then
    have=$(gcloud compute tpus tpu-vm describe "$NAME" "${GC[@]}" --format='value(acceleratorType)')
    [[ ${have##*/} == "$ACCELERATOR" ]] || die "TPU $NAME is ${have##*/}, the mesh needs $ACCELERATOR"
  fi
elif ((QUEUED)); then
  run "${QR[@]}" "$NAME" --node-id "$NAME" --accelerator-type "$ACCELERATOR" \
    --runtime-version "$RUNTIME" "${GC[@]}" ${QR_FLAGS[@]+"${QR_FLAGS[@]}"}
  show gcloud compute tpus queued-resources describe "$NAME" "${GC[@]}" --format='value(state.state)'
  if ! ((DRY_RUN)); then
    while :; do
      state=$(gcloud compute tpus queued-resources describe "$NAME" "${GC[@]}" --format='value(state.state)')
      echo "# queued resource $NAME ($ACCELERATOR, $CAPACITY): $state after $((SECONDS / 60)) min" >&2
      case $state in
        ACTIVE) break ;;
        FAILED|SUSPENDED|SUSPENDING|DELETING)
          die "queued resource $NAME is $state (gcloud compute tpus queued-resources describe $NAME --zone $ZONE says why)" ;;
      esac
      sleep "$POLL"
    done
  fi
else
  run gcloud compute tpus tpu-vm create "$NAME" --accelerator-type "$ACCELERATOR" \
    --version "$RUNTIME" "${GC[@]}"
fi

# 2. The code on every host (~/ddrl_jax), installed by launch/tpu/host_setup.sh (deadsnakes Python,
# dpkg-lock waits, retries) with the TPU and video extras: each host on its own ssh, PARALLEL at once,
# so that the hosts that fail are named. An ssh that cannot connect (exit 255) is retried.
host_ssh() {   # host_ssh W COMMAND: gcloud ssh to worker W, retried when ssh itself fails
  local try rc
  for try in 1 2 3; do
    rc=0
    gcloud compute tpus tpu-vm ssh "$NAME" "${GC[@]}" --worker="$1" --command "$2" || rc=$?
    ((rc == 255)) || return "$rc"
    echo "# worker $1: ssh could not connect (try $try of 3)" >&2
    sleep 10
  done
  return 255
}
install_on() {   # install_on W: the code and the install on worker W
  if [[ -n $tarball ]]; then
    gcloud compute tpus tpu-vm scp "$tarball" "$NAME:ddrl_jax_src.tgz" "${GC[@]}" --worker="$1" || return
  fi
  host_ssh "$1" "$HOST_CMD"
}
if ! ((SKIP_INSTALL)); then
  SETUP="bash ~/ddrl_jax/launch/tpu/host_setup.sh --python=$RPY --extras=tpu,video"
  tarball=''
  if [[ -d $REPO ]]; then
    tarball=${TMPDIR:-/tmp}/ddrl_jax_src.$$.tgz
    run tar -czf "$tarball" -C "$REPO" --exclude-vcs --exclude=./checkpoints --exclude='./workdir*' \
      --exclude='*.egg-info' --exclude=__pycache__ --exclude=.pytest_cache --exclude=./tests/.jax_cache .
    HOST_CMD="rm -rf ~/ddrl_jax && mkdir -p ~/ddrl_jax && tar -xzf ~/ddrl_jax_src.tgz -C ~/ddrl_jax && $SETUP"
  else
    HOST_CMD="if [ -d ~/ddrl_jax/.git ]; then git -C ~/ddrl_jax pull --ff-only; else git clone $(q "$REPO") ~/ddrl_jax; fi && $SETUP"
  fi
  # One ssh first: it makes and propagates the ssh key once, not from PARALLEL processes at once.
  show gcloud compute tpus tpu-vm ssh "$NAME" "${GC[@]}" --worker=0 --command true
  ((DRY_RUN)) || host_ssh 0 true || fail "cannot ssh to worker 0 of $NAME"
  if ((DRY_RUN)); then LOGS='<a new temporary directory>'; else LOGS=$(mktemp -d "${TMPDIR:-/tmp}/ddrl_install.XXXXXX"); fi
  echo "# installing on $R_TPU_HOSTS hosts, $PARALLEL at once; logs: $LOGS/worker-W.log" >&2
  running=0
  for ((w = 0; w < R_TPU_HOSTS; w++)); do
    [[ -z $tarball ]] || show gcloud compute tpus tpu-vm scp "$tarball" "$NAME:ddrl_jax_src.tgz" "${GC[@]}" --worker="$w"
    show gcloud compute tpus tpu-vm ssh "$NAME" "${GC[@]}" --worker="$w" --command "$HOST_CMD"
    ((DRY_RUN)) && continue
    (rc=0; install_on "$w" || rc=$?; echo "$rc" > "$LOGS/worker-$w.rc") > "$LOGS/worker-$w.log" 2>&1 &
    if ((++running >= PARALLEL)); then wait -n || true; ((running--)) || true; fi
  done
  if ! ((DRY_RUN)); then
    wait
    rm -f "$tarball"
    failed=()
    for ((w = 0; w < R_TPU_HOSTS; w++)); do
      [[ $(cat "$LOGS/worker-$w.rc" 2>/dev/null) == 0 ]] || failed+=("$w")
    done
    if ((${#failed[@]})); then
      for w in "${failed[@]}"; do
        echo "--- worker $w (exit $(cat "$LOGS/worker-$w.rc" 2>/dev/null || echo '?')): $LOGS/worker-$w.log" >&2
        tail -n 5 "$LOGS/worker-$w.log" >&2 || true
      done
      fail "the install failed on ${#failed[@]} of $R_TPU_HOSTS hosts of $NAME: workers ${failed[*]} (logs above and in $LOGS). Fix or recreate them, then rerun with --skip-create"
    fi
    echo "# installed on all $R_TPU_HOSTS hosts" >&2
  fi
fi

# 3. Training: the same command on every host, at once. With the Redis reward backend, first the reward
# servers' bearer token, as a file on every host that the train command exports.
TOKEN_SETUP=''
if ((REDIS_REWARDS)); then
  if ((DRY_RUN)); then
    token_file=${TMPDIR:-/tmp}/ddrl_reward_token.XXXXXX
  else
    token_file=$(mktemp "${TMPDIR:-/tmp}/ddrl_reward_token.XXXXXX")      # mode 600
    trap 'rm -f "$token_file"' EXIT
    printf '%s' "$DDRL_REWARD_TOKEN" > "$token_file"
  fi
  run gcloud compute tpus tpu-vm scp "$token_file" "$NAME:.ddrl_reward_token" "${GC[@]}" --worker=all
  # shellcheck disable=SC2016  # expanded by the hosts' shell
  TOKEN_SETUP='chmod 600 ~/.ddrl_reward_token && export DDRL_REWARD_TOKEN="$(cat ~/.ddrl_reward_token)" && '
fi
TRAIN=(-m ddrl_jax.train --config="$R_CONFIG" --workdir="$WORKDIR"
       --compilation_cache_dir="$WORKDIR/xla_cache" ${EXTRA[@]+"${EXTRA[@]}"})
# shellcheck disable=SC2088  # the ~ is for the host's shell, like the other ~ paths
TRAIN_LINE='~/ddrl_venv/bin/python'
for a in "${TRAIN[@]}"; do TRAIN_LINE+=" $(q "$a")"; done
ssh_all "cd ~/ddrl_jax && ${TOKEN_SETUP}export LIBTPU_INIT_ARGS=$(q "$LIBTPU") && $TRAIN_LINE"
