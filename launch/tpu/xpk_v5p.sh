#!/usr/bin/env bash
# shellcheck disable=SC2153
# (SC2153: the R_* variables come from launch/render.py through eval.)
#
# DDRL training as an xpk workload on a GKE cluster with a TPU v5p node pool: optionally build and
# push the image (launch/docker/Dockerfile.tpu), then `xpk workload create` with the slice type the
# config's mesh needs. xpk starts one container per host; jax.distributed detects the slice.
# Untested against a real cluster here: `--dry-run` prints the commands and runs none.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu/xpk_v5p.sh --cluster=CLUSTER --docker-image=IMAGE --workdir=gs://BUCKET/DIR [options] [-- TRAIN_FLAGS...]

Runs on every host of a v5p slice of CLUSTER, in image IMAGE:
  cd /app && export LIBTPU_INIT_ARGS=<preset> && python -m ddrl_jax.train --config=CONFIG --workdir=WORKDIR \
    --compilation_cache_dir=WORKDIR/xla_cache TRAIN_FLAGS

Options (--opt=value or --opt value):
  --config=PATH[:ARG]     config file, relative to the repository (default: configs/cosmos2b.py)
  --cluster=NAME          xpk (GKE) cluster with v5p capacity (required)
  --workload=NAME         workload name, [a-z]([-a-z0-9]*[a-z0-9])?, at most 40 characters
                          (default: ddrl-<config name>-<date>)
  --docker-image=IMAGE    image with this repository installed, in Artifact Registry:
                          REGION-docker.pkg.dev/PROJECT/REPOSITORY/ddrl-jax:tpu (required; Container
                          Registry's gcr.io stopped taking pushes in March 2025 unless the project's
                          gcr.io is served by Artifact Registry)
  --build                 first `docker build -f launch/docker/Dockerfile.tpu -t IMAGE .`, then
                          `gcloud auth configure-docker REGISTRY` (Google registries) and `docker push`
  --project=PROJECT       GCP project (default: gcloud's)
  --zone=ZONE             the cluster's zone (default: gcloud's)
  --device-type=TYPE      slice type (default: from the mesh: 256 chips -> v5p-512, 1024 -> v5p-2048);
                          must have as many chips as the mesh has devices
  --num-slices=N          only 1 (the meshes have no cross-slice axis)
  --workdir=gs://...      checkpoints, metrics, XLA cache (required)
  --libtpu-init-args=STR  replace the LIBTPU_INIT_ARGS preset
  --app-dir=DIR           the repository inside the image (default: /app, Dockerfile.tpu's WORKDIR)
  --dry-run               print every command (lines starting with '+ '), run nothing
  -h, --help              this text
Everything after `--` is passed to ddrl_jax.train.
Needs: xpk and gcloud (authenticated), docker for --build, and python3 with this repository's
requirements on the launching machine (launch/render.py reads the config's mesh).
EOF
}

die() { echo "xpk_v5p.sh: error: $*" >&2; echo "(run with --help for usage)" >&2; exit 2; }
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
# The same preset as launch/tpu/gcloud_v5p.sh (maxdiffusion's v5p list + the latency-hiding scheduler).
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

CONFIG=configs/cosmos2b.py CLUSTER='' WORKLOAD='' IMAGE='' PROJECT='' ZONE='' DEVICE_TYPE=''
NUM_SLICES=1 WORKDIR='' BUILD=0 DRY_RUN=0 APP_DIR=/app
LIBTPU=$LIBTPU_PRESET
EXTRA=()
while (($#)); do
  SHIFT=1
  case $1 in
    -h|--help) usage; exit 0 ;;
    --config|--config=*) take "$@"; CONFIG=$VAL ;;
    --cluster|--cluster=*) take "$@"; CLUSTER=$VAL ;;
    --workload|--workload=*) take "$@"; WORKLOAD=$VAL ;;
    --docker-image|--docker-image=*) take "$@"; IMAGE=$VAL ;;
    --project|--project=*) take "$@"; PROJECT=$VAL ;;
    --zone|--zone=*) take "$@"; ZONE=$VAL ;;
    --device-type|--device-type=*) take "$@"; DEVICE_TYPE=$VAL ;;
    --num-slices|--num-slices=*) take "$@"; NUM_SLICES=$VAL ;;
    --workdir|--workdir=*) take "$@"; WORKDIR=$VAL ;;
    --libtpu-init-args|--libtpu-init-args=*) take "$@"; LIBTPU=$VAL ;;
    --app-dir|--app-dir=*) take "$@"; APP_DIR=$VAL ;;
    --build) BUILD=1 ;;
    --dry-run) DRY_RUN=1 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown option: $1" ;;
  esac
  shift "$SHIFT"
done
[[ -n $CLUSTER ]] || die "--cluster is required"
[[ -n $IMAGE ]] || die "--docker-image is required"
[[ $WORKDIR == gs://?* ]] || die "--workdir must be a gs:// path every host can reach (got '${WORKDIR}')"
[[ $NUM_SLICES == 1 ]] || die "--num-slices=$NUM_SLICES: the configs' meshes fill one slice (use 1)"
WORKDIR=${WORKDIR%/}

RENDER_ARGS=(--config="$CONFIG" --require=tpu)
[[ -n $DEVICE_TYPE ]] && RENDER_ARGS+=(--accelerator="$DEVICE_TYPE")
RENDERED=$("$PYTHON" "$REPO_ROOT/launch/render.py" "${RENDER_ARGS[@]}" --format=shell -- ${EXTRA[@]+"${EXTRA[@]}"}) \
  || die "the config's mesh does not fit (see above)"
eval "$RENDERED"
DEVICE_TYPE=$R_ACCELERATOR
WORKLOAD=${WORKLOAD:-ddrl-$R_NAME-$(date +%m%d-%H%M)}
[[ $WORKLOAD =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ && ${#WORKLOAD} -le 40 ]] \
  || die "--workload '$WORKLOAD': [a-z]([-a-z0-9]*[a-z0-9])?, at most 40 characters (xpk's rule)"
echo "# $R_CONFIG: mesh $R_MESH_DESC = $R_DEVICES devices -> $DEVICE_TYPE ($R_CHIPS chips, $R_TPU_HOSTS hosts)" >&2

REGISTRY=${IMAGE%%/*}
[[ $IMAGE == */* && ( $REGISTRY == *.* || $REGISTRY == *:* || $REGISTRY == localhost ) ]] || REGISTRY=''
case $REGISTRY in
  gcr.io|*.gcr.io)
    echo "# warning: $REGISTRY is Container Registry, which stopped taking pushes in March 2025; unless" \
         "this project's gcr.io is served by Artifact Registry, use REGION-docker.pkg.dev/PROJECT/REPOSITORY/IMAGE" >&2 ;;
esac
if ((BUILD)); then
  run docker build -f "$REPO_ROOT/launch/docker/Dockerfile.tpu" -t "$IMAGE" "$REPO_ROOT"
  # docker's credential helper for Google's registries (one-time per machine; --quiet: no prompt).
  case $REGISTRY in
    *-docker.pkg.dev|*.pkg.dev|gcr.io|*.gcr.io) run gcloud auth configure-docker "$REGISTRY" --quiet ;;
  esac
  run docker push "$IMAGE"
fi

TRAIN=(python -m ddrl_jax.train --config="$R_CONFIG" --workdir="$WORKDIR"
       --compilation_cache_dir="$WORKDIR/xla_cache" ${EXTRA[@]+"${EXTRA[@]}"})
TRAIN_LINE=''
for a in "${TRAIN[@]}"; do TRAIN_LINE+="${TRAIN_LINE:+ }$(q "$a")"; done
XPK=(xpk workload create --cluster "$CLUSTER" --workload "$WORKLOAD" --device-type "$DEVICE_TYPE"
     --num-slices "$NUM_SLICES" --docker-image "$IMAGE")
[[ -n $PROJECT ]] && XPK+=(--project "$PROJECT")
[[ -n $ZONE ]] && XPK+=(--zone "$ZONE")
run "${XPK[@]}" --command "cd $(q "$APP_DIR") && export LIBTPU_INIT_ARGS=$(q "$LIBTPU") && $TRAIN_LINE"
