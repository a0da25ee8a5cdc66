#!/usr/bin/env bash
# Ask a question about an image with curl: the image goes inline as a base64 data URL.
#
#   samples/client_curl.sh [IMAGE] [QUESTION] [BASE_URL]
#
# Defaults: matplotlib's photo of Grace Hopper, "What is in this picture?" and
# http://127.0.0.1:8000. Set MM_SERVE_API_KEY when the server runs with --api-key.
# Needs curl, and a Python with matplotlib for the default photo: $PYTHON, else the project's
# .venv/bin/python (made by `make`), else python3.
set -euo pipefail

venv_python="$(dirname "$0")/../.venv/bin/python"
[[ -x "$venv_python" ]] || venv_python=python3
PYTHON=${PYTHON:-$venv_python}
IMAGE=${1:-$("$PYTHON" -c 'import matplotlib, os; print(os.path.join(matplotlib.get_data_path(), "sample_data", "grace_hopper.jpg"))')}
QUESTION=${2:-"What is in this picture?"}
BASE_URL=${3:-http://127.0.0.1:8000}
AUTH=()
if [[ -n "${MM_SERVE_API_KEY:-}" ]]; then
    AUTH=(-H "Authorization: Bearer ${MM_SERVE_API_KEY}")
fi

case "${IMAGE,,}" in
    *.png) MIME=image/png ;;
    *.jpg | *.jpeg) MIME=image/jpeg ;;
    *.webp) MIME=image/webp ;;
    *.gif) MIME=image/gif ;;
    *) MIME=application/octet-stream ;;
esac

# The first model the server lists.
MODEL=$(curl -sSf "${AUTH[@]}" "${BASE_URL}/v1/models" |
    "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
QUESTION_JSON=$("$PYTHON" -c 'import json, sys; print(json.dumps(sys.argv[1]))' "$QUESTION")
MODEL_JSON=$("$PYTHON" -c 'import json, sys; print(json.dumps(sys.argv[1]))' "$MODEL")

# The body can be megabytes: build it in a file, not on the command line.
BODY=$(mktemp)
trap 'rm -f "$BODY"' EXIT
{
    printf '{"model": %s, "max_tokens": 64, "messages": [{"role": "user", "content": [' "$MODEL_JSON"
    printf '{"type": "image_url", "image_url": {"url": "data:%s;base64,' "$MIME"
    base64 < "$IMAGE" | tr -d '\n'
    printf '"}}, {"type": "text", "text": %s}]}]}' "$QUESTION_JSON"
} > "$BODY"

curl -sS "${AUTH[@]}" "${BASE_URL}/v1/chat/completions" \
    -H "Content-Type: application/json" \
    --data-binary "@${BODY}"
echo
