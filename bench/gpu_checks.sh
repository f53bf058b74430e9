#!/usr/bin/env bash
# Every GPU check of one lent GPU, in one go, each step under its own time limit; logs and metrics go to OUT_DIR.
#
#     bash bench/gpu_checks.sh OUT_DIR [STEPS...]     # STEPS: tests llama fp8 tp_step compile profile (default all)
#
# tests    tests/test_cuda.py: one GPU against the CPU, and 2- and 4-rank layouts sharing the GPU over gloo
# llama    llama-1b through `tensorpar train` (bf16, 4 x 4 micro-batches of 2,048 tokens): MFU, eager
# compile  the same with --compile
# fp8      bench/precision.py: bf16 vs fp8 (tensorwise, rowwise) step time on llama-1b
# tp_step  bench/tp_step.py: tensorpar's model against plain PyTorch on one GPU
# profile  bench/profile_train.py: where llama-1b's step time goes
# Not in the default list (name them): issue 43's speed and memory checks
# doc_attention  bench/document_attention.py: llama-1b at seq-len 8192 on ~256-token documents, no mask / dense /
#                varlen / flex: peak memory and step time
# moe_gemm       bench/moe_step.py: grouped (torch._grouped_mm, bf16) vs looped expert GEMMs on one GPU
# levers         bench/memory_levers.py: llama-1b bf16 with each memory lever: GPU and host bytes, step time
# fp8_compile    llama-1b in fp8 (tensorwise) with --compile: does fusing the casts make fp8 pay at this size?
# no_chunk       llama-1b compiled with --loss-chunk-tokens 0: the LM head once, not again in the backward
# fp8_wide       bf16 and fp8 (tensorwise), both compiled, on llama-8b's width with 8 of its 32 layers (hidden 4,096):
#                where the blocks' GEMMs hold more of the step than at llama-1b's size (docs/benchmarks.md)
# fp8_profile    bf16 and fp8 (tensorwise), both compiled, on llama-1b under torch.profiler: device time by kind
# offload        bench/memory_levers.py as `levers`, the plain run and each offload only (activations: every
#                layer's, and the first 4 layers' only); `levers` and `offload`
#                print the planner's step time beside the measured one (PLAN_GPU, the catalog's GPU: h200), and
#                again with the host link they time each way first (`link planned s`, `planned_link=`)
# offload_profile  llama-1b eager with --activation-offload under torch.profiler: the copies' kernels and their time
# grad_accum     bench/grad_accumulation.py: the fp32 gradient accumulation of bf16 parameters, mixed-dtype add vs
#                a cast then an add vs compiled, over llama-1b's 1.24B elements in 4M-element slices
# A step over its time limit gets SIGABRT, on which Python prints every thread's stack (PYTHONFAULTHANDLER).
# TESTS_K=EXPR selects tests by pytest's -k expression; PROFILE_PRECISIONS="fp8" profiles fp8 only; PLAN_GPU=NAME
# the catalog GPU the levers' steps are planned on (default h200).
set -u
OUT="${1:?usage: bench/gpu_checks.sh OUT_DIR [STEPS...]}"
shift
STEPS="${*:-tests llama fp8 tp_step compile profile}"
PY="${PYTHON:-python3}"
RUNS="${TMPDIR:-/tmp}/tensorpar-gpu-checks"  # the runs' folders (plots, configs); OUT_DIR keeps logs and metrics
mkdir -p "$OUT" "$RUNS"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
LLAMA=(--model llama-1b --device cuda --dtype bf16 --seq-len 2048 --micro-batch-size 4 --global-batch-size 16)

step() {  # step NAME[:PART] SECONDS COMMAND...: run it with a time limit, its output in OUT/NAME[_PART].log
    local name=$1 limit=$2
    shift 2
    case " $STEPS " in *" ${name%%:*} "*) ;; *) return ;; esac
    name=${name/:/_}
    echo "== $name ($(date +%T), limit ${limit}s): $*"
    timeout -s ABRT -k 15 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? after ${SECONDS}s in all"
    tail -n 25 "$OUT/$name.log"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$RUNS/machine.txt"
step tests 240 env TENSORPAR_TEST_CUDA=1 "$PY" -m pytest -q tests/test_cuda.py --durations=8 -p no:cacheprovider \
    ${TESTS_K:+-k "$TESTS_K"}
step llama 120 "$PY" -m tensorpar train "${LLAMA[@]}" --steps 10 --sample-tokens 0 --val-fraction 0 --val-every 0 \
    --no-progress --out-dir "$RUNS/llama" --metrics "$OUT/llama.jsonl"
step fp8 180 "$PY" bench/precision.py --device cuda --model llama-1b --precisions bf16,fp8-tensorwise,fp8-rowwise \
    --steps 10 --seq-len 2048 --global-batch-size 16 --micro-batch-size 4 --threads 8
step tp_step 120 "$PY" bench/tp_step.py --device cuda --dtype bf16 --hidden 2048 --layers 16 --heads 16 \
    --seq-len 2048 --batch 8 --vocab 32768 --variants single,single-chunked,plain,plain-fp32-loss --steps 10 \
    --comm-steps 0
step compile 240 "$PY" -m tensorpar train "${LLAMA[@]}" --steps 10 --sample-tokens 0 --val-fraction 0 --val-every 0 \
    --no-progress --out-dir "$RUNS/compile" --metrics "$OUT/compile.jsonl" --compile
step profile 120 "$PY" bench/profile_train.py "${LLAMA[@]}" --steps 4 --rows 25
step doc_attention 300 "$PY" bench/document_attention.py --device cuda --model llama-1b --dtype bf16 \
    --variants none,dense,varlen,flex --steps 5 --threads 8
step moe_gemm 240 "$PY" bench/moe_step.py --layouts single --device cuda --dtype bf16 --hidden 1024 --expert-ffn 2816 \
    --experts 16 --seq-len 1024 --global-batch 8 --micro-batch 2 --steps 5 --threads 8
step levers 400 "$PY" bench/memory_levers.py --device cuda --model llama-1b --dtype bf16 --seq-len 2048 \
    --global-batch-size 8 --micro-batch-size 2 --steps 6 --threads 8 --plan "${PLAN_GPU:-h200}"
step offload 300 "$PY" bench/memory_levers.py --device cuda --model llama-1b --dtype bf16 --seq-len 2048 \
    --global-batch-size 8 --micro-batch-size 2 --steps 6 --threads 8 --plan "${PLAN_GPU:-h200}" \
    --variants none,optimizer-offload,activation-offload,first-4-layers
step grad_accum 120 "$PY" bench/grad_accumulation.py --device cuda --elements 1236000000 --slice 4194304
step offload_profile 150 "$PY" bench/profile_train.py "${LLAMA[@]}" --micro-batch-size 2 --global-batch-size 8 \
    --steps 3 --activation-offload --rows 8 --kernels 20
for precision in ${PROFILE_PRECISIONS:-bf16 fp8}; do
    step "fp8_profile:$precision" 180 "$PY" bench/profile_train.py "${LLAMA[@]/bf16/$precision}" --steps 5 --compile \
        --rows 12 --kernels 25
done
step fp8_compile 120 "$PY" -m tensorpar train "${LLAMA[@]/bf16/fp8}" --steps 6 --sample-tokens 0 --val-fraction 0 \
    --val-every 0 --no-progress --out-dir "$RUNS/fp8_compile" --metrics "$OUT/fp8_compile.jsonl" --compile
step no_chunk 120 "$PY" -m tensorpar train "${LLAMA[@]}" --steps 6 --sample-tokens 0 --val-fraction 0 --val-every 0 \
    --no-progress --out-dir "$RUNS/no_chunk" --metrics "$OUT/no_chunk.jsonl" --compile --loss-chunk-tokens 0
WIDE="$RUNS/llama-8b-width-8-layers.json"
case " $STEPS " in *" fp8_wide "*)
    "$PY" -c "import json, sys, dataclasses; from tensorpar.models.presets import get_config
json.dump(dataclasses.replace(get_config('llama-8b'), num_layers=8).to_dict(), open(sys.argv[1], 'w'))" "$WIDE" ;;
esac
for precision in bf16 fp8; do
    step "fp8_wide:$precision" 300 "$PY" -m tensorpar train --model "$WIDE" --device cuda --dtype "$precision" --seq-len 2048 \
        --micro-batch-size 2 --global-batch-size 8 --steps 6 --sample-tokens 0 --val-fraction 0 --val-every 0 \
        --no-progress --out-dir "$RUNS/fp8_wide_$precision" --metrics "$OUT/fp8_wide_$precision.jsonl" --compile
done
