python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpu-site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1
export PYTHONPATH=$PWD/.gpu-site
bench() { python3 -m mm_serve.entrypoints.cli bench "$@"; }
MM_SERVE_STEP_TIMELINE=/tmp/tl.jsonl bench throughput --model-arch qwen2-vl-2b --num-prompts 256 --input-len 18 --output-len 128 --image-size 448 448 --max-model-len 4096 --no-hf --repeats 2 2>&1 | grep -v -i warn | grep -E "mm_serve|roofline" | tail -6
python3 -m mm_serve.benchmarks.step_timeline /tmp/tl.jsonl 2>&1 | tail -5
timeout 100 python3 -m mm_serve.benchmarks.ttft --model-arch qwen2-vl-2b 2>&1 | tail -9
timeout 150 python3 -m mm_serve.benchmarks.kernel_profile --model-arch qwen2-vl-2b --max-model-len 4096 --image-size 448 448 --top 30 2>&1 | grep -v -i warn | tail -36
timeout 200 python3 -m pytest -q -x tests/test_cuda_graphs.py 2>&1 | tail -3
