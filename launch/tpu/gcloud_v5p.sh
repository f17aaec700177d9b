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
  --skip-create           use an existing slice NAME (its accelerator type is checked first)
  --skip-install          do not copy/install the repository (already done on the hosts)
  --remote-python=PY      the hosts' Python for ~/ddrl_venv, an apt package (default: python3.11;
                          jax 0.10.2 needs >= 3.11, the v2-alpha-tpuv5 image has 3.10)
  --libtpu-init-args=STR  replace the LIBTPU_INIT_ARGS preset
  --poll-seconds=N        queued-resource poll interval (default: 60)
  --dry-run               print every command (lines starting with '+ '), run nothing
  -h, --help              this text
Everything after `--` is passed to ddrl_jax.train (e.g. -- --config.num_iterations=2).
Needs: gcloud (authenticated), and python3 with this repository's requirements on the launching
machine (launch/render.py reads the config's mesh).
EOF
}

die() { echo "gcloud_v5p.sh: error: $*" >&2; echo "(run with --help for usage)" >&2; exit 2; }
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
WORKDIR=${WORKDIR%/}

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
  run gcloud compute tpus queued-resources create "$NAME" --node-id "$NAME" \
    --accelerator-type "$ACCELERATOR" --runtime-version "$RUNTIME" "${GC[@]}"
  show gcloud compute tpus queued-resources describe "$NAME" "${GC[@]}" --format='value(state.state)'
  if ! ((DRY_RUN)); then
    while :; do
      state=$(gcloud compute tpus queued-resources describe "$NAME" "${GC[@]}" --format='value(state.state)')
      echo "# queued resource $NAME ($ACCELERATOR): $state" >&2
      case $state in
        ACTIVE) break ;;
        FAILED|SUSPENDED|SUSPENDING|DELETING) die "queued resource $NAME is $state" ;;
      esac
      sleep "$POLL"
    done
  fi
else
  run gcloud compute tpus tpu-vm create "$NAME" --accelerator-type "$ACCELERATOR" \
    --version "$RUNTIME" "${GC[@]}"
fi

# 2. The code on every host (~/ddrl_jax), installed with the TPU and video extras.
if ! ((SKIP_INSTALL)); then
  if [[ -d $REPO ]]; then
    tarball=${TMPDIR:-/tmp}/ddrl_jax_src.$$.tgz
    run tar -czf "$tarball" -C "$REPO" --exclude-vcs --exclude=./checkpoints --exclude='./workdir*' \
      --exclude='*.egg-info' --exclude=__pycache__ --exclude=.pytest_cache .
    run gcloud compute tpus tpu-vm scp "$tarball" "$NAME:ddrl_jax_src.tgz" "${GC[@]}" --worker=all
    ssh_all "rm -rf ~/ddrl_jax && mkdir -p ~/ddrl_jax && tar -xzf ~/ddrl_jax_src.tgz -C ~/ddrl_jax"
    ((DRY_RUN)) || rm -f "$tarball"
  else
    ssh_all "if [ -d ~/ddrl_jax/.git ]; then git -C ~/ddrl_jax pull --ff-only; else git clone $(q "$REPO") ~/ddrl_jax; fi"
  fi
  # jax 0.10.2 needs Python >= 3.11; the v2-alpha-tpuv5 image (Ubuntu 22.04) has 3.10, so a virtualenv
  # of Ubuntu's python3.11 package (--remote-python) holds the install.
  ssh_all "sudo apt-get update -qq && sudo apt-get install -y -qq $RPY $RPY-venv && $RPY -m venv ~/ddrl_venv && cd ~/ddrl_jax && ~/ddrl_venv/bin/python -m pip install -U pip && ~/ddrl_venv/bin/python -m pip install -e '.[tpu,video]'"
fi

# 3. Training: the same command on every host, at once.
TRAIN=(-m ddrl_jax.train --config="$R_CONFIG" --workdir="$WORKDIR"
       --compilation_cache_dir="$WORKDIR/xla_cache" ${EXTRA[@]+"${EXTRA[@]}"})
# shellcheck disable=SC2088  # the ~ is for the host's shell, like the other ~ paths
TRAIN_LINE='~/ddrl_venv/bin/python'
for a in "${TRAIN[@]}"; do TRAIN_LINE+=" $(q "$a")"; done
ssh_all "cd ~/ddrl_jax && export LIBTPU_INIT_ARGS=$(q "$LIBTPU") && $TRAIN_LINE"
