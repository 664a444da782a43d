#!/usr/bin/env bash
# One node of a multi-node run: one `accelerate launch` starts this node's GPUS_PER_NODE processes, which meet the
# other nodes' processes at MASTER_ADDR:MASTER_PORT (c10d rendezvous, hosted by node 0). sft_multinode.sbatch runs
# it once per node; elsewhere run it on each node yourself, with the same values and that node's NODE_RANK.
# Arguments: the recipe script and its arguments.
#
# With an accelerate config that has a parallelism_config (fsdp2_hsdp_multinode.yaml, the default) the run is HSDP:
# replicated across the NNODES nodes, sharded over the GPUS_PER_NODE GPUs of each (the config's own sizes are
# replaced; dp_replicate_size in the recipe config chooses another layout). With a config that has none (e.g.
# fsdp2.yaml), or with dp_replicate_size: 1 in the recipe config, the model is sharded over every GPU of every node.
set -euo pipefail
: "${NNODES:?the number of nodes}" "${NODE_RANK:?this node: 0 to NNODES-1}" "${GPUS_PER_NODE:?processes per node}"
: "${MASTER_ADDR:?the address of node 0, reachable from every node}" "${MASTER_PORT:?a free port on node 0}"
# The default is the project's config, found beside this script whatever the working directory (a recipe of your own
# runs from its folder); a path you set, as the recipe's arguments, is read from the working directory.
project=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-$project/accelerate_configs/fsdp2_hsdp_multinode.yaml}
# Else accelerate's FileNotFoundError traceback on every node.
if [ ! -f "$ACCELERATE_CONFIG" ]; then
    echo "error: ACCELERATE_CONFIG $ACCELERATE_CONFIG: no such file in $PWD: set ACCELERATE_CONFIG to the config's" \
        "path" >&2
    exit 2
fi
# Counted from 1 (nodes 1 and 2), no node would host the rendezvous: each would wait 10 minutes for it, then fail.
if ! [[ $NNODES =~ ^[1-9][0-9]*$ && $GPUS_PER_NODE =~ ^[1-9][0-9]*$ && $NODE_RANK =~ ^[0-9]+$ ]] ||
        [ "$NODE_RANK" -ge "$NNODES" ]; then
    echo "error: NNODES=$NNODES, GPUS_PER_NODE=$GPUS_PER_NODE and NODE_RANK=$NODE_RANK: the first two must be" \
        "positive whole numbers, NODE_RANK one from 0 to NNODES-1" >&2
    exit 2
fi

# On one node accelerate gives c10d no address, and it would take torch's fixed port 29400 instead of MASTER_PORT,
# colliding with any other job on the node: torchrun's static rendezvous on MASTER_PORT there.
# On several, node 0 hosts the rendezvous store; telling the others so keeps them from trying to host it when
# MASTER_ADDR happens to be one of their own addresses (as on one test machine). They wait read_timeout seconds for it
# (torch's default, 60 s, gave up after about 2.5 minutes); node 0 waits for them torch's join_timeout, 600 s.
if [ "$NNODES" = 1 ]; then
    rendezvous=(--rdzv_backend static)
else
    if [ "$NODE_RANK" = 0 ]; then is_host=true; else is_host=false; fi
    rendezvous=(--rdzv_backend c10d --rdzv_conf "is_host=$is_host,read_timeout=600")
fi

exec accelerate launch --config_file "$ACCELERATE_CONFIG" \
    --num_machines "$NNODES" --num_processes "$((NNODES * GPUS_PER_NODE))" --machine_rank "$NODE_RANK" \
    --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" "${rendezvous[@]}" \
    --parallelism_config_dp_replicate_size "$NNODES" --parallelism_config_dp_shard_size "$GPUS_PER_NODE" \
    "$@"
