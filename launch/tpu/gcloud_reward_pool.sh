#!/usr/bin/env bash
# shellcheck disable=SC2153
# (SC2153: the R_* variables come from launch/render.py through eval.)
# A GPU reward pool on Compute Engine for a training job that runs elsewhere, e.g. on a TPU v5p slice
# (launch/tpu/gcloud_v5p.sh): N GPU VMs (default a3-highgpu-8g: 8 H100 80GB each) whose startup script
# installs this repository with the video_rewards extra and runs one `python -m ddrl_jax.rewards.serve`
# per GPU (a systemd unit per GPU, CUDA_VISIBLE_DEVICES=i, restarted when it exits) on the Redis queue
# that the trainer fills (--config.reward.backend=redis). `--delete` tears the VMs down.
# Untested against real Compute Engine here: `--dry-run` prints the commands and runs none.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu/gcloud_reward_pool.sh --zone=ZONE --redis-url=URL [options] [-- TRAIN_FLAGS...]
       launch/tpu/gcloud_reward_pool.sh --zone=ZONE [--vms=N] [--name=NAME] --delete

Creates VMs NAME-0 .. NAME-<N-1>; on every GPU i of each (DDRL_REWARD_TOKEN from the VM's metadata):
  CUDA_VISIBLE_DEVICES=i /opt/ddrl_venv/bin/python -m ddrl_jax.rewards.serve --redis=URL --workers=W
Then train with the same DDRL_REWARD_TOKEN in the environment, e.g. on a TPU slice:
  bash launch/tpu/gcloud_v5p.sh ... -- --config.reward.backend=redis --config.reward.redis_url=URL TRAIN_FLAGS

Options (--opt=value or --opt value):
  --zone=ZONE             GCE zone with the GPUs' quota (required)
  --redis-url=URL         a Redis server that these VMs and the trainer both reach, e.g. Memorystore's
                          redis://10.0.0.3:6379/0 in the same VPC (required unless --delete)
  --config=PATH[:ARG]     the training config (default: configs/cosmos2b.py); with the train flags after
                          `--` it is checked here: the rewards must build, the torch ones must be given
                          device 'cuda', and its config.reward.imports become the servers' --imports
  --vms=N                 GPU VMs (default: 1)
  --name=NAME             VM name prefix (default: ddrl-rewards): NAME-0, NAME-1, ...
  --project=PROJECT       GCP project (default: gcloud's configured project)
  --machine-type=TYPE     default a3-highgpu-8g (8 x H100 80GB); a2-ultragpu-8g, a3-megagpu-8g, ...
                          (the GPUs of accelerator-optimized types come with them)
  --accelerator=TYPE      GPUs to attach to an N1 machine type, e.g. nvidia-tesla-t4 (needs --gpus-per-vm)
  --gpus-per-vm=N         GPUs per VM = reward servers per VM (default: the machine type's, a3-highgpu-8g -> 8)
  --reward-workers-per-gpu=N  reward worker processes per server (default: 1); each one loads its own
                          copy of the reward models on the server's GPU
  --image-family=F        boot image family, Ubuntu 22.04 with the NVIDIA driver
                          (default: ubuntu-accelerator-2204-amd64-with-nvidia-580)
  --image-project=P       (default: ubuntu-os-accelerator-images)
  --boot-disk-size=SIZE   (default: 300GB: the virtualenv with torch, and the reward weights)
  --boot-disk-type=TYPE   (default: pd-balanced; A3 Ultra / A4 take hyperdisk-balanced)
  --network-interface=SPEC  gcloud's --network-interface (default: nic-type=GVNIC, the default network;
                          e.g. nic-type=GVNIC,subnet=SUBNET,no-address to reach Redis in another subnet)
  --spot                  Spot VMs (--provisioning-model=SPOT): a preempted server's tasks are requeued
  --reservation=NAME      consume this reservation (--reservation-affinity=specific); 8-GPU A3 capacity
                          usually comes from a reservation or Spot, rarely on demand
  --repo=PATH|GIT_URL     what the VMs install in /opt/ddrl_jax: a git URL (cloned), or a local checkout
                          (default: this one), tarred and uploaded to --staging
  --staging=gs://DIR      where a local checkout is uploaded (ddrl_jax_src.tgz) for the VMs to fetch
  --weights=gs://DIR      reward weights the VMs copy to --weights-dir before the servers start
  --weights-dir=DIR       (default: /opt/ddrl_weights); the trainer's config.reward.kwargs name files there
  --imports=MODULES       the servers' --imports (default: the config's config.reward.imports)
  --delete                delete the VMs NAME-0 .. NAME-<N-1> (gcloud compute instances delete --quiet)
  --print-startup-script  print the VMs' startup script and exit
  --dry-run               print every command (lines starting with '+ '), run nothing
  -h, --help              this text
Everything after `--` is the train command's flags; their --config.* overrides (e.g.
--config.reward.fns=..., --config.reward.kwargs=...) are applied to --config before it is checked.
Environment: DDRL_REWARD_TOKEN (required unless --delete: the bearer token the trainer sends; it reaches
the VMs as instance metadata `ddrl-reward-token`, from a file, never on a command line), PYTHON (the
launching python, default python3).
Needs: gcloud (authenticated), GPU quota in the zone, and python3 with this repository's requirements.
EOF
}

die() { echo "gcloud_reward_pool.sh: error: $*" >&2; echo "(run with --help for usage)" >&2; exit 2; }
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
CONFIG=configs/cosmos2b.py ZONE='' REDIS_URL='' VMS=1 NAME=ddrl-rewards PROJECT='' MACHINE=a3-highgpu-8g
ACCEL='' GPV='' WPG=1 IMAGE_FAMILY=ubuntu-accelerator-2204-amd64-with-nvidia-580
IMAGE_PROJECT=ubuntu-os-accelerator-images DISK=300GB DISK_TYPE=pd-balanced NIC=nic-type=GVNIC SPOT=0 REPO=$REPO_ROOT STAGING=''
WEIGHTS='' WEIGHTS_DIR=/opt/ddrl_weights IMPORTS='' IMPORTS_SET=0 RESERVATION='' DELETE=0 PRINT=0 DRY_RUN=0
EXTRA=()
while (($#)); do
  SHIFT=1
  case $1 in
    -h|--help) usage; exit 0 ;;
    --config|--config=*) take "$@"; CONFIG=$VAL ;;
    --zone|--zone=*) take "$@"; ZONE=$VAL ;;
    --redis-url|--redis-url=*) take "$@"; REDIS_URL=$VAL ;;
    --vms|--vms=*) take "$@"; VMS=$VAL ;;
    --name|--name=*) take "$@"; NAME=$VAL ;;
    --project|--project=*) take "$@"; PROJECT=$VAL ;;
    --machine-type|--machine-type=*) take "$@"; MACHINE=$VAL ;;
    --accelerator|--accelerator=*) take "$@"; ACCEL=$VAL ;;
    --gpus-per-vm|--gpus-per-vm=*) take "$@"; GPV=$VAL ;;
    --reward-workers-per-gpu|--reward-workers-per-gpu=*) take "$@"; WPG=$VAL ;;
    --image-family|--image-family=*) take "$@"; IMAGE_FAMILY=$VAL ;;
    --image-project|--image-project=*) take "$@"; IMAGE_PROJECT=$VAL ;;
    --boot-disk-size|--boot-disk-size=*) take "$@"; DISK=$VAL ;;
    --boot-disk-type|--boot-disk-type=*) take "$@"; DISK_TYPE=$VAL ;;
    --network-interface|--network-interface=*) take "$@"; NIC=$VAL ;;
    --repo|--repo=*) take "$@"; REPO=$VAL ;;
    --staging|--staging=*) take "$@"; STAGING=$VAL ;;
    --weights|--weights=*) take "$@"; WEIGHTS=$VAL ;;
    --weights-dir|--weights-dir=*) take "$@"; WEIGHTS_DIR=$VAL ;;
    --imports|--imports=*) take "$@"; IMPORTS=$VAL; IMPORTS_SET=1 ;;
    --reservation|--reservation=*) take "$@"; RESERVATION=$VAL ;;
    --spot) SPOT=1 ;;
    --delete) DELETE=1 ;;
    --print-startup-script) PRINT=1 ;;
    --dry-run) DRY_RUN=1 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown option: $1" ;;
  esac
  shift "$SHIFT"
done
positive() { [[ $2 =~ ^[1-9][0-9]*$ ]] || die "$1 must be a positive number (got '$2')"; }
((PRINT)) || [[ -n $ZONE ]] || die "--zone is required"
positive --vms "$VMS"
[[ $NAME =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || die "--name '$NAME': lowercase letters, digits and '-'"
NAMES=()
for ((v = 0; v < VMS; v++)); do NAMES+=("$NAME-$v"); done
GC=(--zone "$ZONE")
[[ -n $PROJECT ]] && GC+=(--project "$PROJECT")

# Tear-down: nothing else is needed.
if ((DELETE)); then
  run gcloud compute instances delete "${NAMES[@]}" "${GC[@]}" --quiet
  exit 0
fi

positive --reward-workers-per-gpu "$WPG"
[[ -n $REDIS_URL ]] || die "--redis-url is required: a Redis server that the VMs and the trainer both reach (redis://HOST:6379/0)"
[[ $REDIS_URL =~ ^rediss?://[^[:space:]\'\"%\$\\]+$ ]] \
  || die "--redis-url must be a redis://HOST:PORT/DB (or rediss://) URL without spaces, quotes, '%', '\$' or '\\' (got '$REDIS_URL')"
case $REDIS_URL in
  redis://localhost[:/]*|redis://127.*|rediss://localhost[:/]*|rediss://127.*)
    die "--redis-url=$REDIS_URL is each VM itself: give an address the VMs and the trainer both reach" ;;
esac
if ! ((PRINT)); then
  [[ -n ${DDRL_REWARD_TOKEN:-} ]] \
    || die "DDRL_REWARD_TOKEN is not set: export the bearer token that the trainer sends (the same value in its environment), e.g. export DDRL_REWARD_TOKEN=\$(openssl rand -hex 16)"
fi
if [[ -z $GPV ]]; then
  [[ -z $ACCEL ]] || die "--accelerator=$ACCEL needs --gpus-per-vm=N (how many to attach)"
  [[ $MACHINE =~ ^[a-z][a-z0-9]*-[a-z]+gpu-([0-9]+)g$ ]] \
    || die "--machine-type=$MACHINE: cannot tell its GPUs; give --gpus-per-vm=N (and --accelerator=TYPE for N1)"
  GPV=${BASH_REMATCH[1]}
fi
positive --gpus-per-vm "$GPV"
[[ $WEIGHTS_DIR == /* ]] || die "--weights-dir must be an absolute path (got '$WEIGHTS_DIR')"
[[ -z $WEIGHTS || $WEIGHTS == gs://?* ]] || die "--weights must be a gs:// path (got '$WEIGHTS')"
[[ -z $STAGING || $STAGING == gs://?* ]] || die "--staging must be a gs:// path (got '$STAGING')"
STAGING=${STAGING%/}
if [[ -d $REPO ]]; then
  [[ -n $STAGING ]] || die "--repo is a local checkout ($REPO): give --staging=gs://BUCKET/DIR to upload it to, or --repo=GIT_URL"
  SRC_URI=$STAGING/ddrl_jax_src.tgz
else
  SRC_URI=''
fi
[[ -z $IMPORTS || $IMPORTS =~ ^[A-Za-z_][A-Za-z0-9_.]*(,[A-Za-z_][A-Za-z0-9_.]*)*$ ]] \
  || die "--imports must be comma-separated module names (got '$IMPORTS')"

# The reward config the trainer will send (launch/render.py --rewards; exits 2 naming what is wrong).
RENDERED=$("$PYTHON" "$REPO_ROOT/launch/render.py" --config="$CONFIG" --rewards --format=shell \
  -- ${EXTRA[@]+"${EXTRA[@]}"}) || die "the config's rewards cannot be served by this pool (see above)"
eval "$RENDERED"
CONFIG=$R_CONFIG
((IMPORTS_SET)) || IMPORTS=$R_REWARD_IMPORTS
if ! ((PRINT)); then
  if [[ -n $R_REWARD_GPU ]]; then
    echo "# $CONFIG: rewards $R_REWARD_FNS; on the GPU: $R_REWARD_GPU" >&2
  else
    echo "# warning: none of $CONFIG's rewards ($R_REWARD_FNS) runs on a GPU; these servers score on the CPU" >&2
  fi
fi

startup_script() {   # the VMs' startup script (root, every boot; its log: the serial console, journalctl)
  local serve units='' i
  serve="/opt/ddrl_venv/bin/python -m ddrl_jax.rewards.serve --redis=$REDIS_URL --workers=$WPG --name=%H-gpu%i"
  [[ -z $IMPORTS ]] || serve+=" --imports=$IMPORTS"
  for ((i = 0; i < GPV; i++)); do units+=" ddrl-reward@$i"; done
  cat <<EOF
#!/bin/bash
# ddrl_jax reward pool VM (launch/tpu/gcloud_reward_pool.sh): install once, then one reward server per
# GPU, each a systemd unit ddrl-reward@i with CUDA_VISIBLE_DEVICES=i. Logs: journalctl -u 'ddrl-reward@*'.
set -euo pipefail
export PATH=\$PATH:/snap/bin HOME=\${HOME:-/root}
GPUS=$GPV
log() { echo "ddrl-reward-pool: \$*"; }
retry() { local t; for t in 1 2 3 4; do "\$@" && return 0; log "try \$t of 4 failed: \$*"; sleep \$((20 * t)); done; return 1; }
for try in 1 2 3 4 5 6 7 8 9 10 11 12; do   # the driver may still be loading at boot
  have=\$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  [[ \$have == "\$GPUS" ]] && break
  log "nvidia-smi lists \${have:-no} GPUs, expected \$GPUS (try \$try of 12)"; sleep 10
done
if [[ \$have != "\$GPUS" ]]; then log "error: nvidia-smi lists \${have:-no} GPUs, this pool expects \$GPUS"; exit 1; fi
if [[ ! -f /opt/ddrl_jax/.ddrl_installed ]]; then
  rm -rf /opt/ddrl_jax && mkdir -p /opt/ddrl_jax
EOF
  if [[ -n $SRC_URI ]]; then
    printf '  retry gcloud storage cp %s /tmp/ddrl_jax_src.tgz\n  tar -xzf /tmp/ddrl_jax_src.tgz -C /opt/ddrl_jax\n' "$(q "$SRC_URI")"
  else
    printf '  retry git clone %s /opt/ddrl_jax\n' "$(q "$REPO")"
  fi
  cat <<EOF
  # Python 3.11 (deadsnakes), /opt/ddrl_venv, pip install -e '.[video_rewards]' (torch with CUDA from PyPI).
  bash /opt/ddrl_jax/launch/tpu/host_setup.sh --python=python3.11 --extras=video_rewards --venv=/opt/ddrl_venv
  retry /opt/ddrl_venv/bin/python -m pip install -q --no-deps vbench==0.1.5   # VBench's AMT-S network
EOF
  if [[ -n $WEIGHTS ]]; then
    printf '  mkdir -p %s\n  retry gcloud storage rsync --recursive %s %s\n' "$(q "$WEIGHTS_DIR")" "$(q "$WEIGHTS")" "$(q "$WEIGHTS_DIR")"
  fi
  cat <<EOF
  /opt/ddrl_venv/bin/python -c 'import sys, torch; n = torch.cuda.device_count(); sys.exit(0 if n == $GPV else f"torch {torch.__version__} sees {n} GPUs, not $GPV (a CPU build of torch?)")'
  touch /opt/ddrl_jax/.ddrl_installed
fi
# The bearer token from the instance metadata (set from a file by gcloud_reward_pool.sh), readable by root only.
token=\$(curl -fsS -H 'Metadata-Flavor: Google' http://metadata.google.internal/computeMetadata/v1/instance/attributes/ddrl-reward-token)
(umask 077 && printf 'DDRL_REWARD_TOKEN=%s\\n' "\$token" > /etc/ddrl-reward.env)
cat > /etc/systemd/system/ddrl-reward@.service <<'UNIT'
[Unit]
Description=ddrl_jax reward server on GPU %i
Wants=network-online.target
After=network-online.target

[Service]
EnvironmentFile=/etc/ddrl-reward.env
Environment=CUDA_VISIBLE_DEVICES=%i CUDA_DEVICE_ORDER=PCI_BUS_ID JAX_PLATFORMS=cpu HOME=/root
WorkingDirectory=/opt/ddrl_jax
ExecStart=$serve
Restart=always
RestartSec=10

[Install]
WantedBy=multi-user.target
UNIT
systemctl daemon-reload
systemctl enable$units
systemctl restart$units
log "serving $REDIS_URL with \$GPUS reward servers (one per GPU)"
EOF
}

if ((PRINT)); then
  startup_script
  exit 0
fi

# 1. The code: a git URL is cloned by the VMs; a local checkout is uploaded for them.
if [[ -n $SRC_URI ]]; then
  tarball=${TMPDIR:-/tmp}/ddrl_jax_src.$$.tgz
  run tar -czf "$tarball" -C "$REPO" --exclude-vcs --exclude=./checkpoints --exclude='./workdir*' \
    --exclude='*.egg-info' --exclude=__pycache__ --exclude=.pytest_cache --exclude=./tests/.jax_cache .
  run gcloud storage cp "$tarball" "$SRC_URI"
  ((DRY_RUN)) || rm -f "$tarball"
fi

# 2. The VMs. The startup script and the token go in as files (the token never on a command line).
if ((DRY_RUN)); then
  files=${TMPDIR:-/tmp}/ddrl_reward_pool.XXXXXX
else
  files=$(mktemp -d "${TMPDIR:-/tmp}/ddrl_reward_pool.XXXXXX")
  trap 'rm -rf "$files"' EXIT
  startup_script > "$files/startup.sh"
  (umask 077 && printf '%s' "$DDRL_REWARD_TOKEN" > "$files/token")
fi
CREATE=(gcloud compute instances create "${NAMES[@]}" "${GC[@]}" --machine-type="$MACHINE")
[[ -n $ACCEL ]] && CREATE+=(--accelerator="type=$ACCEL,count=$GPV")
CREATE+=(--maintenance-policy=TERMINATE --image-family="$IMAGE_FAMILY" --image-project="$IMAGE_PROJECT"
         --boot-disk-size="$DISK" --boot-disk-type="$DISK_TYPE" --network-interface="$NIC" --labels=ddrl-role=reward-pool
         --metadata-from-file="startup-script=$files/startup.sh,ddrl-reward-token=$files/token")
((SPOT)) && CREATE+=(--provisioning-model=SPOT)
[[ -n $RESERVATION ]] && CREATE+=(--reservation-affinity=specific --reservation="$RESERVATION")
run "${CREATE[@]}"

hint=''
for a in --config.reward.backend=redis --config.reward.redis_url="$REDIS_URL" ${EXTRA[@]+"${EXTRA[@]}"}; do
  hint+=" $(q "$a")"
done
cat >&2 <<EOF
# $VMS VMs x $GPV GPUs = $((VMS * GPV)) reward servers ($WPG worker(s) each) on $REDIS_URL once installed
# (minutes; the startup script's log: gcloud compute instances get-serial-port-output $NAME-0 --zone $ZONE).
# Live servers: redis-cli -u $REDIS_URL --scan --pattern 'ddrl:reward:server:*'
# Train with the same DDRL_REWARD_TOKEN in the environment and the train flags --$hint
#   e.g. bash launch/tpu/gcloud_v5p.sh --config=$CONFIG --zone=$ZONE --workdir=gs://BUCKET/DIR --$hint
# Tear down: bash launch/tpu/gcloud_reward_pool.sh --zone=$ZONE --vms=$VMS --name=$NAME --delete
EOF
