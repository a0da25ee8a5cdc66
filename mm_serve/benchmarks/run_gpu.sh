#!/usr/bin/env bash
# The GPU measurements behind BENCHMARKS.md, one stage per argument, each writing its log and
# JSON into $OUT (default ./bench-out). Run from the repository root on a CUDA machine:
#   bash mm_serve/benchmarks/run_gpu.sh tests latency throughput serve kernels
# tests:      the CUDA tests (kernels vs references, CUDA graphs, compile, outputs vs HF, async
#             scheduling, pixel path, structured outputs, Qwen3-VL); tests-kernels, tests-llm,
#             tests-vlm and tests-outputs run its four parts (each within the GPU machine's 10
#             minutes per command; at the default compilation level every engine a test builds
#             compiles its forward). Beyond the serving wheels, the test files import jsonschema
#             and xgrammar: ../shared/gpu-wheels.sh jsonschema jsonschema-specifications
#             referencing rpds-py attrs xgrammar apache-tvm-ffi
# latency:    bench latency, Qwen2-VL-2B, batch 1: default, without PDL, without async
#             scheduling, eager; then step_profile (the engine loop's step, kernel table)
# throughput: bench throughput, Qwen2-VL-2B, 256 requests, HF baseline, prefix caching on/off
# structured: bench throughput, Qwen2-VL-2B, 256 requests, with and without a JSON schema on each
# serve:      mm-serve serve (Qwen2-VL-2B, random weights) driven by bench serve
# kernels:    the Triton kernel benchmark
# epilogue:   the fused MLP GEMM: its tests (the packed bf16 rounding among them), then
#             epilogue_cost (each epilogue variant's time and its outputs against the engine's)
# tower-attention: the tower's attention on same-size images (vision_attention rows: cuDNN in
#             parts and in one call, torch's flash and efficient kernels); one encode step of
#             workload 1 through the tower's graphs by chunking and in one eager forward
#             (tower_chunks --eager --host-ahead); bench kernels' workload decode table
# gemv:       the batch-1 linear layers, Triton GEMV against cuBLAS, PDL off and on
# startup:    mm-serve serve start to healthy, compilation levels 1 and 2, first and cached start
# peer-serve: vLLM's bench serve (random-mm, 448x448, 50 in / 128 out) at 2, 16, 32 req/s against
#             mm-serve and vLLM 0.33 (installed in /tmp/vsite), each fresh; cold start; verdicts.
#             PEER_ENGINES=vllm (or mm_serve) runs one; a later run into the same $OUT reports both.
# families:   bench throughput of each family's published architecture (dummy weights), 128
#             requests x one 448x448 image + 18 words -> 128 tokens; FAMILIES=... picks some,
#             PEER=vllm adds vLLM 0.33 side by side (installed in /tmp/vsite)
# profile:    workload 1's engine profiled in its own processes, device activity only: warm run 3
#             of warm_runs with output length 1 (encode and prefill steps) and 128, each read by
#             trace_gaps (busy against idle), and the step timeline of the same runs
# host-profile: py-spy (raw stacks, every thread) of the engine's processes during warm runs
#             2-6 of workload 1 (LEN: output length, 128), and sync_points: the lines where a
#             step makes the host wait for the device. py-spy on PATH: ../shared/gpu-wheels.sh
#             py-spy, installed with the others (--target DIR puts it in DIR/bin)
# first-batch-stacks: py-spy with native frames (every thread) of the engine's processes over
#             the first large batch after start-up (warm_runs, 3 s from the end of its four
#             warm-up requests), read by native_waits: what the engine core's main thread spins
#             in while its encode steps run in lock-step with the device (BENCHMARKS.md)
# launches:   graph_launches (host time inside launches on a busy device, the engine's replays
#             during a warm batch of workload 1), then warm_runs with uni, mp, uni, mp on the same
#             machine (3 runs each): on a host whose decode steps are host-paced, does mp help?
# exit-stacks: bench throughput of workload 1; once an engine core logs that its threads and
#             sockets stopped, py-spy (native) dumps it 2 s later: where a core that the front
#             end then kills after 5 s ("ignored SIGTERM") is stuck. py-spy on PATH
# timelines:  workload 1, four batches of one engine, with the step timeline and the front end's
#             (front_end_timeline): each batch's share, and per batch the time outside the
#             engine's steps, the output backlog, and the steps by class (decode host ms)
# multi-gpu:  two GPUs (NCCL, NVLink multicast off): the tensor-parallel tests on CUDA; decode at
#             batch 1 with TP=1 and TP=2; bench throughput (Qwen2-VL-7B, 256 x 448x448 image +
#             50 tokens -> 128) at DP=1, DP=2 and TP=2; PEER=vllm adds vLLM at TP=1 and TP=2
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
$PY -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1 || true
bench() { $PY -m mm_serve.entrypoints.cli bench "$@"; }

for stage in "$@"; do
  echo "=== $stage ($(date +%T))"
  case $stage in
    tests|tests-kernels|tests-llm|tests-vlm|tests-outputs)
      files=()
      [[ $stage == tests || $stage == tests-kernels ]] && files+=(tests/test_kernels_triton.py
        tests/test_cuda_graphs.py tests/test_compile.py tests/test_kernel_dispatch.py
        tests/test_varlen_prefill.py)
      [[ $stage == tests || $stage == tests-llm ]] && files+=(tests/test_async_scheduling.py
        tests/test_llm_vs_hf.py)
      [[ $stage == tests || $stage == tests-vlm ]] && files+=(tests/test_vlm_vs_hf.py)
      [[ $stage == tests || $stage == tests-outputs ]] && files+=(tests/test_pixel_path.py
        tests/test_structured_outputs.py tests/test_qwen3_vl.py)
      $PY -m pytest -q -x "${files[@]}" 2>&1 | tee "$OUT/$stage.log" | tail -5 ;;
    latency)
      for mode in "" "no-pdl" "--no-async-scheduling" "--enforce-eager"; do
        name=latency${mode//-/_}
        pdl=1; [ "$mode" = no-pdl ] && { pdl=0; mode=""; }
        MM_SERVE_PDL=$pdl bench latency --model-arch qwen2-vl-2b --batch-size 1 --input-len 50 \
          --output-len 128 --num-iters 10 --num-iters-warmup 3 $mode --output-json "$OUT/$name.json" \
          2>&1 | tee "$OUT/$name.log" | tail -14
      done
      $PY -m mm_serve.benchmarks.step_profile --batch-size 1 --kernels 2>&1 \
        | tee "$OUT/step_profile.log" | head -24 ;;
    throughput)
      bench throughput --model-arch qwen2-vl-2b --num-prompts 256 --input-len 50 \
        --output-len 128 --image-size 448 448 --hf-batch-sizes 16 32 64 128 256 \
        --compare-prefix-caching --repeats 3 --output-json "$OUT/throughput.json" \
        2>&1 | tee "$OUT/throughput.log" | tail -25 ;;
    structured)
      bench throughput --model-arch qwen2-vl-2b --num-prompts 256 --input-len 50 \
        --output-len 128 --image-size 448 448 --no-hf --compare-structured-outputs --repeats 2 \
        --output-json "$OUT/structured.json" 2>&1 | tee "$OUT/structured.log" | tail -12 ;;
    serve)
      folder=$(mktemp -d)
      $PY -c "from mm_serve.benchmarks.architectures import write_architecture as w; \
        w('qwen2-vl-2b', '$folder')"
      $PY -m mm_serve.entrypoints.cli serve "$folder" --load-format dummy --port 8123 \
        >"$OUT/server.log" 2>&1 &
      server=$!
      $PY -c "import time, httpx
for _ in range(300):
    try:
        if httpx.get('http://127.0.0.1:8123/health').status_code == 200: break
    except httpx.HTTPError: pass
    time.sleep(1)" 
      bench serve --port 8123 --num-prompts 256 --request-rate 16 --input-len 50 \
        --output-len 128 --image-size 448 448 --ignore-eos --num-warmups 4 \
        --output-json "$OUT/serve.json" 2>&1 | tee "$OUT/serve.log" | tail -40
      kill $server; wait $server ;;
    kernels)
      $PY -m mm_serve.benchmarks.kernels 2>&1 | tee "$OUT/kernels.log" | tail -20 ;;
    epilogue)
      $PY -m pytest -q tests/test_fused_mlp.py 2>&1 | tee "$OUT/fused_mlp_tests.log" | tail -3
      $PY -m mm_serve.benchmarks.epilogue_cost 2>&1 | tee "$OUT/epilogue_cost.log" ;;
    tower-attention)
      $PY -c "from mm_serve.benchmarks.vision_attention import *
print_vision_attention(vision_attention_rows())" 2>&1 | tee "$OUT/vision_attention.log"
      $PY -m mm_serve.benchmarks.tower_chunks --eager --host-ahead 2>&1 \
        | tee "$OUT/tower_chunks.log"
      $PY -c "from mm_serve.benchmarks.kernels import *
from mm_serve.benchmarks.roofline import copy_rate
print_workload_decode(workload_decode_rows(copy_rate('cuda')))" 2>&1 | tee "$OUT/decode.log" ;;
    gemv)
      $PY -m mm_serve.benchmarks.gemv --out "$OUT" 2>&1 | tee "$OUT/gemv.log" | tail -24 ;;
    startup)
      $PY -m mm_serve.benchmarks.startup --model-arch qwen2-vl-2b --levels 1 2 \
        --output-json "$OUT/startup.json" 2>&1 | tee "$OUT/startup.log" | tail -6 ;;
    peer-serve)
      $PY -m mm_serve.benchmarks.peer_serve --model-arch qwen2-vl-2b --out "$OUT/peer_serve" \
        --engines ${PEER_ENGINES:-mm_serve vllm} 2>&1 | tee "$OUT/peer_serve.log" | tail -22 ;;
    families)
      for arch in ${FAMILIES:-qwen2.5-vl-7b qwen3-vl-8b internvl3-8b llava-onevision-qwen2-7b-ov gemma-3-4b}; do
        peer=(); [ -n "${PEER:-}" ] && peer=(--peer "$PEER" --peer-pythonpath /tmp/vsite)
        bench throughput --model-arch "$arch" --num-prompts 128 --input-len 18 --output-len 128 \
          --image-size 448 448 --max-model-len 8192 --no-hf --repeats 1 "${peer[@]}" \
          --output-json "$OUT/family_$arch.json" 2>&1 | tee "$OUT/family_$arch.log" | tail -6
      done ;;
    profile)
      for len in 1 128; do
        dir="$OUT/traces$len"
        MM_SERVE_TORCH_PROFILER_DIR="$dir" MM_SERVE_TORCH_PROFILER_ACTIVITIES=cuda \
          MM_SERVE_STEP_TIMELINE="$OUT/timeline$len.jsonl" $PY -m mm_serve.benchmarks.warm_runs \
          --model-arch qwen2-vl-2b --image-size 448 448 --max-model-len 4096 --runs 3 \
          --output-len $len --profile-run 3 2>&1 | tee "$OUT/profile$len.log" | grep "^run"
        $PY -m mm_serve.benchmarks.step_timeline "$OUT/timeline$len.jsonl" 2>&1 | tail -5
        $PY -m mm_serve.benchmarks.trace_gaps "$dir"/*.gz 2>&1 \
          | tee "$OUT/trace_gaps$len.log" | head -16
        rm -rf "$dir"  # traces of tens of MB: the summaries are kept
      done ;;
    host-profile)
      $PY -m mm_serve.benchmarks.warm_runs --model-arch qwen2-vl-2b --image-size 448 448 \
        --max-model-len 4096 --runs 6 --output-len "${LEN:-128}" >"$OUT/host_profile.log" 2>&1 &
      runs=$!
      until grep -q "^run 1" "$OUT/host_profile.log" || ! kill -0 $runs 2>/dev/null; do sleep 0.2; done
      py-spy record --pid $runs --subprocesses --threads --rate 250 --duration 9 --format raw \
        --output "$OUT/host_profile.txt" >/dev/null 2>&1
      wait $runs; grep "^run" "$OUT/host_profile.log"
      $PY -m mm_serve.benchmarks.sync_points --model-arch qwen2-vl-2b --image-size 448 448 \
        --max-model-len 4096 2>&1 | tee "$OUT/sync_points.log" | grep -A30 synchronising ;;
    first-batch-stacks)
      $PY -m mm_serve.benchmarks.warm_runs --model-arch qwen2-vl-2b --image-size 448 448 \
        --max-model-len 4096 --runs 2 >"$OUT/first_batch.log" 2>&1 &
      runs=$!
      until grep -q "^warm-up done" "$OUT/first_batch.log" || ! kill -0 $runs 2>/dev/null; do
        sleep 0.05
      done
      py-spy record --pid $runs --subprocesses --threads --native --rate 500 --duration 3 \
        --format raw --output "$OUT/first_batch_stacks.txt" >/dev/null 2>&1
      wait $runs; grep "^run" "$OUT/first_batch.log"
      $PY -m mm_serve.benchmarks.native_waits "$OUT/first_batch_stacks.txt" --threads 4 ;;
    exit-stacks)
      bench throughput --model-arch qwen2-vl-2b --num-prompts 256 --input-len 18 \
        --output-len 128 --image-size 448 448 --max-model-len 4096 --no-hf --repeats 2 \
        >"$OUT/exit.log" 2>&1 &
      runs=$!; dumped=0
      while kill -0 $runs 2>/dev/null; do
        stopped=$(grep -c "stopped its threads and sockets" "$OUT/exit.log")
        if (( stopped > dumped )); then
          pid=$(grep -o "engine core process (pid [0-9]*)" "$OUT/exit.log" | sed -n "${stopped}p" \
            | grep -o "[0-9]*")
          sleep 2
          py-spy dump --native --pid "$pid" >"$OUT/exit_stacks_$stopped.txt" 2>&1
          dumped=$stopped
        fi
        sleep 0.2
      done
      grep "ignored SIGTERM\|out tok/s\|^mm_serve\|roofline" "$OUT/exit.log"
      head -60 "$OUT"/exit_stacks_*.txt ;;
    launches)
      $PY -m mm_serve.benchmarks.graph_launches --model-arch qwen2-vl-2b --image-size 448 448 \
        --max-model-len 4096 --output-len 128 2>&1 | tee "$OUT/graph_launches.log" | tail -14
      for backend in uni mp uni mp; do
        echo "$backend: $($PY -m mm_serve.benchmarks.warm_runs --model-arch qwen2-vl-2b \
          --image-size 448 448 --max-model-len 4096 --runs 3 --distributed-executor-backend \
          $backend 2>&1 | grep '^run' | cut -d' ' -f3 | tr '\n' ' ')"
      done | tee "$OUT/backends.log" ;;
    timelines)
      MM_SERVE_STEP_TIMELINE="$OUT/tl.jsonl" $PY -m mm_serve.benchmarks.front_end_timeline \
        --record "$OUT/fe.jsonl" bench throughput --model-arch qwen2-vl-2b --num-prompts 256 \
        --input-len 18 --output-len 128 --image-size 448 448 --max-model-len 4096 --no-hf \
        --repeats 4 --output-json "$OUT/timelines.json" 2>&1 | grep "roofline"
      $PY -c "import json; d = json.load(open('$OUT/timelines.json')); \
        print('batches, out tok/s:', [round(x) for x in d['mm_serve']['all_runs_output_tokens_per_s']])"
      # The timed batches (256 requests; the warm-up calls have fewer), and their engine runs.
      $PY -m mm_serve.benchmarks.front_end_timeline --summary "$OUT/fe.jsonl" "$OUT/tl.jsonl" \
        | grep "| 256 requests" | tee "$OUT/timelines.log"
      for run in $(grep -o "step timeline run [0-9]*" "$OUT/timelines.log" | cut -d' ' -f4); do
        $PY -m mm_serve.benchmarks.step_timeline "$OUT/tl.jsonl" --run $run | grep "^wall\|^decode [0-9]* "
      done 2>&1 | tee -a "$OUT/timelines.log" ;;
    multi-gpu)
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
      MM_SERVE_TP_TEST_DEVICE=cuda $PY -m pytest -q tests/test_tensor_parallel.py 2>&1 \
        | tee "$OUT/tp_tests.log" | tail -5
      for tp in 1 2; do
        bench latency --model-arch qwen2-vl-7b --batch-size 1 --input-len 50 --output-len 128 \
          --num-iters 10 --num-iters-warmup 3 --tensor-parallel-size $tp \
          --output-json "$OUT/latency_tp$tp.json" 2>&1 | tee "$OUT/latency_tp$tp.log" | tail -8
      done
      for run in dp1:1:1 dp2:2:1 tp2:1:2; do
        IFS=: read -r name dp tp <<< "$run"
        peer=()
        [ -n "${PEER:-}" ] && [ "$dp" = 1 ] && peer=(--peer "$PEER" --peer-pythonpath /tmp/vsite
          --peer-engine-args "{\"tensor_parallel_size\": $tp}")
        bench throughput --model-arch qwen2-vl-7b --num-prompts 256 --input-len 50 \
          --output-len 128 --image-size 448 448 --no-hf --repeats 1 --data-parallel-size "$dp" \
          --tensor-parallel-size "$tp" "${peer[@]}" --output-json "$OUT/multi_$name.json" \
          2>&1 | tee "$OUT/multi_$name.log" | tail -6
      done ;;
    *) echo "unknown stage $stage" ;;
  esac
done
