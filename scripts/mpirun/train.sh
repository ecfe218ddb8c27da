#!/usr/bin/env bash
# Data-parallel training with Open MPI's mpirun starting every mtrain-train rank (no
# mtrain-launch). Each rank reads its place from OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/
# LOCAL_SIZE; --backend mpi (the default under mpirun) needs no store, --backend gloo
# gets one from rank 0 over MPI. Guide: docs/mpirun.md.
#
#   scripts/mpirun/train.sh                                      # 2 ranks on this machine
#   scripts/mpirun/train.sh --per-node 2 -- --model simplecnn --epochs 2 --backend gloo
#   scripts/mpirun/train.sh --hostfile my-hosts --per-node 8 --threads 4 -- --model resnet18
#   scripts/mpirun/train.sh --dry-run --hostfile scripts/mpirun/hostfile.example
#
# Options (everything after -- goes to mtrain-train unchanged):
#   --np N           total ranks (default: --per-node x the hosts of the hostfile, or
#                    --per-node on this machine)
#   --per-node N     ranks per node: --map-by ppr:N:node (default 2)
#   --hostfile FILE  Open MPI hostfile, one "host slots=N" per line (default: none, this
#                    machine only); scripts/mpirun/hostfile.example is a sample
#   --threads N      OMP_NUM_THREADS exported to every rank with -x (default 1)
#   --bind-to WHAT   core (each rank pinned to --threads cores: --map-by ...:PE=N),
#                    socket or none (default: core when the ranks and their threads fit
#                    this machine's cores, else none)
#   --bin PATH       the mtrain-train binary (default: build/bin/mtrain-train of this
#                    checkout, else the one on PATH); on several hosts it must exist
#                    at the same path on each
#   --mpirun-args S  further mpirun arguments, split on spaces (e.g. "--mca btl self,tcp")
#   --dry-run        print the mpirun command and exit
# Forwarded to every rank when set: MASTER_ADDR, MASTER_PORT, MTRAIN_STORE_TOKEN (a
# fixed store for --backend gloo instead of the MPI-announced one), PATH, LD_LIBRARY_PATH.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
need_value() { [[ $# -ge 2 ]] || { echo "mpirun/train.sh: $1 expects a value, found the end of the command line" >&2; exit 2; }; }
fail() { echo "mpirun/train.sh: $*" >&2; exit 2; }

root=$(cd "$(dirname "$0")/../.." && pwd)
np=""
per_node=2
hostfile=""
threads=1
bind_to=""
bin=""
extra_mpirun=""
dry_run=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --np) need_value "$@"; np=$2; shift 2 ;;
    --per-node) need_value "$@"; per_node=$2; shift 2 ;;
    --hostfile) need_value "$@"; hostfile=$2; shift 2 ;;
    --threads) need_value "$@"; threads=$2; shift 2 ;;
    --bind-to) need_value "$@"; bind_to=$2; shift 2 ;;
    --bin) need_value "$@"; bin=$2; shift 2 ;;
    --mpirun-args) need_value "$@"; extra_mpirun=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) fail "unknown option '$1' (mtrain-train's own flags go after --; see --help)" ;;
  esac
done

for v in per_node threads; do
  [[ ${!v} =~ ^[1-9][0-9]*$ ]] || fail "--${v/_/-} expects a positive integer, got '${!v}'"
done
[[ -z $np || $np =~ ^[1-9][0-9]*$ ]] || fail "--np expects a positive integer, got '$np'"
case "${bind_to:-core}" in core|socket|none) ;; *) fail "--bind-to expects core, socket or none, got '$bind_to'" ;; esac
[[ -z $hostfile || -r $hostfile ]] || fail "--hostfile $hostfile: no such readable file"

if [[ -z $bin ]]; then
  if [[ -x $root/build/bin/mtrain-train ]]; then
    bin=$root/build/bin/mtrain-train
  else
    bin=$(command -v mtrain-train || true)
  fi
fi
[[ -n $bin && -x $bin ]] || fail "mtrain-train not found or not executable (${bin:-not on PATH}); build first (scripts/setup.sh) or pass --bin"
command -v mpirun >/dev/null || fail "mpirun not found; install Open MPI (Debian: openmpi-bin)"

# Launcher variables win over Open MPI's in mtrain-train (docs/mpirun.md), and ranks on
# this host inherit mpirun's environment: a shell left over from a torchrun or
# mtrain-launch session would override mpirun's ranks.
for v in RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK; do
  if [[ -n ${!v+set} ]]; then
    echo "mpirun/train.sh: unsetting $v=${!v} (a launcher's variable; mpirun says who each rank is)" >&2
    unset "$v"
  fi
done

args=()
# Open MPI refuses to start as root unless told otherwise: one rank's mistake could
# damage the whole system. In a container root is the only user and the container is
# the boundary, so the flag is the norm there; anywhere else, run as a normal user.
if [[ $(id -u) == 0 ]]; then
  args+=(--allow-run-as-root)
fi
[[ -n $hostfile ]] && args+=(--hostfile "$hostfile")
[[ -n $np ]] && args+=(-np "$np")

# On this machine alone, more ranks than cores need --oversubscribe (Open MPI counts one
# slot per core); with a hostfile the slots come from its slots=N.
# On one machine every rank is on this node, whatever --per-node says.
[[ -z $hostfile && -n $np ]] && per_node=$np
cores=$(nproc)
oversubscribed=0
if [[ -z $hostfile ]] && (( per_node > cores )); then
  args+=(--oversubscribe)
  oversubscribed=1
fi
# Binding to cores only helps when every rank gets its own; an oversubscribed node
# cannot honour it (mpirun refuses to bind more ranks than cores).
if [[ -z $bind_to ]]; then
  if (( oversubscribed == 0 && per_node * threads <= cores )); then bind_to=core; else bind_to=none; fi
fi
if [[ $bind_to == core ]]; then
  args+=(--map-by "ppr:$per_node:node:PE=$threads" --bind-to core)
else
  args+=(--map-by "ppr:$per_node:node" --bind-to "$bind_to")
fi

# -x copies a variable into every rank's environment, on remote hosts too (local ranks
# inherit mpirun's environment anyway; remote ones get only what -x names).
args+=(-x "OMP_NUM_THREADS=$threads")
for v in MASTER_ADDR MASTER_PORT MTRAIN_STORE_TOKEN PATH LD_LIBRARY_PATH; do
  [[ -n ${!v:-} ]] && args+=(-x "$v")
done
if [[ -n $extra_mpirun ]]; then
  read -r -a extra <<< "$extra_mpirun"
  args+=("${extra[@]}")
fi

cmd=(mpirun "${args[@]}" "$bin" "$@")
echo "+ ${cmd[*]}"
(( dry_run )) && exit 0
exec "${cmd[@]}"
