python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpu-site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1
export PYTHONPATH=$PWD/.gpu-site
bench() { python3 -m mm_serve.entrypoints.cli bench "$@"; }
MM_SERVE_STEP_TIMELINE=/tmp/tl.jsonl bench throughput --model-arch qwen2-vl-2b --num-prompts 256 --input-len 18 --output-len 128 --image-size 448 448 --max-model-len 4096 --no-hf --repeats 1 2>&1 | grep -v -i warn | tail -8
python3 -m mm_serve.benchmarks.step_timeline /tmp/tl.jsonl 2>&1 | tail -25
folder=$(mktemp -d)
python3 -c "from mm_serve.benchmarks.architectures import write_architecture as w; w('qwen2-vl-2b', '$folder')"
python3 -m mm_serve.entrypoints.cli serve "$folder" --load-format dummy --port 8123 --max-model-len 4096 > /tmp/server.log 2>&1 &
server=$!
python3 -c "import time, httpx
for _ in range(300):
    try:
        if httpx.get('http://127.0.0.1:8123/health').status_code == 200: break
    except httpx.HTTPError: pass
    time.sleep(1)"
for rate in 16 32; do
bench serve --port 8123 --num-prompts 384 --request-rate $rate --input-len 50 --output-len 128 --image-size 448 448 --ignore-eos --num-warmups 4 2>&1 | grep -E -i "ttft|tpot|itl|through|fail" | head -14
done
kill $server; wait $server
grep -i -E "captured|error|traceback" /tmp/server.log | head
