#!/usr/bin/env bash
# Seconds from `make serve` on a fresh clone of this checkout to the first answer about the
# demo's example image (the figure in the README's quick start), and how long the first and
# the second answer took once /health said ready.
#
#   samples/time_first_answer.sh
#
# Serves on a free port, and stops only what it started: `make serve` runs in its own process
# group (set -m), which the server, the engine core and the preprocessing workers inherit.
set -euo pipefail
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
work=$(mktemp -d)
git clone -q "$repo" "$work/mm_serve" && cd "$work/mm_serve"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url="http://127.0.0.1:$port"

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

start=$(now)
set -m  # the background job below gets its own process group, whose id is its pid
make serve ARGS="--port $port" >"$work/serve.log" 2>&1 &
pid=$!
set +m

stop() {
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 50); do  # up to 10 s for a graceful shutdown
        kill -0 -- "-$pid" 2>/dev/null || break
        sleep 0.2
    done
    kill -KILL -- "-$pid" 2>/dev/null || true
    rm -rf "$work"
}
trap stop EXIT

until curl -sf "$url/health" >/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "make serve exited; the end of its log:" >&2
        tail -n 30 "$work/serve.log" >&2
        exit 1
    fi
    sleep 0.5
done
up=$(now)

image=$(base64 -w0 samples/demo_vlm/example.png)
body=$(mktemp -p "$work")
printf '{"messages": [{"role": "user", "content": [
  {"type": "image_url", "image_url": {"url": "data:image/png;base64,%s"}},
  {"type": "text", "text": "%s"}]}], "max_tokens": 64}' "$image" "Describe the image." >"$body"
ask() {
    curl -sSf "$url/v1/chat/completions" -H 'Content-Type: application/json' \
        --data-binary "@$body" |
        python3 -c "import json, sys; print(json.load(sys.stdin)['choices'][0]['message']['content'])"
}
ask
first=$(now)
ask >/dev/null
second=$(now)
echo "server up after $(since "$start" "$up") s; first answer after $(since "$start" "$first") s"
echo "after /health: first answer $(since "$up" "$first") s, second $(since "$first" "$second") s"
