"""The ``mm-serve`` command line: ``--help`` shows the real defaults, byte sizes take units,
``--chat-template`` and ``--log-level`` reach the server, ``mm-serve chat`` with and without
an image against a real server."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mm_serve.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineArgs, load_chat_template
from mm_serve.entrypoints.cli import (
    DEMO_MODEL,
    build_parser,
    main,
    server_config_from,
)
from mm_serve.entrypoints.cli_flags import (
    _UNSET_DEFAULTS,
    engine_args_from,
    format_byte_size,
    parse_byte_size,
)
from tests.fixtures.server import assert_group_gone, free_port
from tests.fixtures.vlm_checkpoints import build_tiny_vlm_checkpoint

EXAMPLE_IMAGE = Path(__file__).resolve().parents[1] / "samples" / "demo_vlm" / "example.png"
PREFIX = "Answer in one word."  # what the --chat-template file adds to the checkpoint's


def help_defaults(argv: list[str], capsys) -> dict[str, str]:
    """``mm-serve ... --help`` -> {flag: its help text (wrapped lines joined)}."""
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    entries: dict[str, str] = {}
    flag = None
    for line in capsys.readouterr().out.splitlines():
        match = re.match(r"  (--[\w-]+)", line)
        if match:
            flag = match[1]
            entries[flag] = line
        elif flag and line.startswith("     "):
            entries[flag] += line
        else:
            flag = None
    return {flag: " ".join(text.split()) for flag, text in entries.items()}


def shown_default(help_text: str) -> str | None:
    assert help_text.count("(default:") <= 1, help_text  # never printed twice
    match = re.search(r"\(default: (.*)\)$", help_text)
    return match and match[1]


def test_serve_help_shows_the_config_defaults(capsys) -> None:
    entries = help_defaults(["serve"], capsys)
    assert "(default: None)" not in " ".join(entries.values())
    assert shown_default(entries["--max-num-batched-tokens"]) == "8192"
    assert DEFAULT_MAX_NUM_BATCHED_TOKENS == 8192  # the README's figure
    for field in dataclasses.fields(EngineArgs):
        if field.name == "model":
            continue
        shown = shown_default(entries["--" + field.name.replace("_", "-")])
        if field.default is None:
            assert shown == _UNSET_DEFAULTS[field.name], field.name
        elif field.name.endswith("_bytes"):
            assert shown == format_byte_size(field.default), field.name
        else:
            assert shown == str(field.default), field.name
    assert shown_default(entries["--max-request-body-bytes"]) == "64MiB"
    assert shown_default(entries["--max-media-bytes"]) == "20MiB"
    assert shown_default(entries["--log-level"]) == "info"
    assert shown_default(entries["--port"]) == "8000"


def test_parsed_defaults_are_the_config_defaults() -> None:
    """No flag given: the same ``EngineArgs`` and ``ServerConfig`` as their constructors."""
    from mm_serve.entrypoints.openai.api_server import ServerConfig

    args = build_parser(["serve", "some/model"]).parse_args(["serve", "some/model"])
    assert engine_args_from(args) == EngineArgs(model="some/model")
    assert server_config_from(args) == ServerConfig()
    demo = build_parser(["serve"]).parse_args(["serve"])
    assert demo.model == str(DEMO_MODEL)


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser(["--version"]).parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mm-serve {importlib.metadata.version('mm_serve')}"


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_api_key_from_the_environment_and_never_in_the_help(command, monkeypatch, capsys):
    argv = [command, "a question"] if command == "chat" else [command]
    monkeypatch.delenv("MM_SERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    assert build_parser(argv).parse_args(argv).api_key == "vllm-key"
    monkeypatch.setenv("MM_SERVE_API_KEY", "our-key")
    assert build_parser(argv).parse_args(argv).api_key == "our-key"
    flagged = [*argv, "--api-key", "flag-key"]
    assert build_parser(flagged).parse_args(flagged).api_key == "flag-key"
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args([command, "--help"])
    help_text = capsys.readouterr().out
    assert "$MM_SERVE_API_KEY" in help_text and "our-key" not in help_text


def test_chat_help_shows_each_default_once(capsys) -> None:
    entries = help_defaults(["chat"], capsys)
    assert shown_default(entries["--url"]) == "http://127.0.0.1:8000"
    assert shown_default(entries["--max-tokens"]) == "256"
    assert shown_default(entries["--temperature"]) == "the server's"
    assert shown_default(entries["--api-key"]) == "$MM_SERVE_API_KEY or $VLLM_API_KEY"


@pytest.mark.parametrize(
    "text, size",
    [
        ("4096", 4096),
        ("0", 0),
        ("512MiB", 512 << 20),
        ("2GiB", 2 << 30),
        ("2gib", 2 << 30),
        ("1 KiB", 1024),
        ("1.5GB", 1_500_000_000),
        ("64kB", 64_000),
        ("3B", 3),
        ("1TiB", 1 << 40),
    ],
)
def test_parse_byte_size(text: str, size: int) -> None:
    assert parse_byte_size(text) == size


@pytest.mark.parametrize("text", ["2G", "512M", "-1", "abc", "", "GiB", "1.2.3GiB", "1 GiBs"])
def test_parse_byte_size_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="invalid byte size"):
        parse_byte_size(text)


def test_format_byte_size_round_trips() -> None:
    for size in (0, 1, 1000, 1024, 20 << 20, 3 << 30, (1 << 30) + 1, 5 << 40):
        assert parse_byte_size(format_byte_size(size)) == size
    assert format_byte_size(2 << 30) == "2GiB"
    assert format_byte_size(1536 << 20) == "1536MiB"


def test_every_byte_flag_takes_units(capsys) -> None:
    argv = ["serve", "--max-media-bytes", "1MiB", "--max-request-body-bytes", "3MB"]
    argv += ["--cpu-kv-cache-bytes", "256MiB"]
    args = build_parser(argv).parse_args(argv)
    assert (args.max_media_bytes, args.max_request_body_bytes) == (1 << 20, 3_000_000)
    assert args.cpu_kv_cache_bytes == 256 << 20
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--cpu-kv-cache-bytes", "2G"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --cpu-kv-cache-bytes: invalid byte size '2G'" in err


def test_chat_arguments() -> None:
    parse = build_parser(["chat"]).parse_args
    args = parse(["chat", "Hello there"])
    assert (args.image, args.question) == (None, "Hello there")
    args = parse(["chat", "photo.jpg", "What is this?", "--max-tokens", "5"])
    assert (args.image, args.question, args.max_tokens) == ("photo.jpg", "What is this?", 5)


def test_chat_with_an_image_but_no_question_is_an_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["chat", str(EXAMPLE_IMAGE)])
    assert exit_info.value.code == 2
    assert "is a file: ask a question too" in capsys.readouterr().err


def test_load_chat_template(tmp_path) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert load_chat_template(str(tmp_path / "t.jinja")) == template
    assert load_chat_template(template) == template
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither Jinja text nor a readable file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")


# ---- against a real server -------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory) -> str:
    return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=3)


@pytest.fixture(scope="module")
def template_file(vlm_path, tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(PREFIX + AutoTokenizer.from_pretrained(vlm_path).chat_template)
    return path


@pytest.fixture(scope="module")
def server(vlm_path, template_file, tmp_path_factory):
    """``mm-serve serve`` with ``--chat-template`` and ``--log-level warning``; yields (url,
    path of its stdout + stderr), which holds all its log lines once it has stopped."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("log") / "serve.log"
    command = [sys.executable, "-m", "mm_serve.entrypoints.launch", "serve", vlm_path]
    command += ["--port", str(port), "--max-model-len", "512", "--num-kv-blocks", "64"]
    command += ["--chat-template", str(template_file), "--log-level", "warning"]
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _healthy(url):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)
        yield url, log_path
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0
        assert_group_gone(proc.pid)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def greedy_answer(url: str, question: str, image: Path | None):
    """The server's non-streamed greedy answer, through the SDK."""
    from mm_serve.client import Client

    with Client(url) as client:
        images = [image] if image else []
        reply = client.chat(text=question, images=images, temperature=0, max_tokens=12)
    return reply


def run_chat(url: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mm_serve.entrypoints.cli", "chat", *args]
    command += ["--url", url, "--temperature", "0", "--max-tokens", "12"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("image", [None, EXAMPLE_IMAGE], ids=["text-only", "image"])
def test_chat_command_against_a_server(server, image) -> None:
    url, _ = server
    question = "What is in the picture?"
    proc = run_chat(url, *([str(image)] if image else []), question)
    assert proc.returncode == 0, proc.stderr
    expected = greedy_answer(url, question, image).choices[0].message.content
    assert expected  # the comparison below means something
    assert proc.stdout == expected + "\n"


def test_chat_command_reports_an_unreachable_server() -> None:
    proc = run_chat(f"http://127.0.0.1:{free_port()}", "Hello? " * 50)  # no file name: too long
    assert proc.returncode == 1
    assert proc.stderr.startswith("\nmm-serve chat: ")


def test_server_uses_the_chat_template_file(server, vlm_path, template_file) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vlm_path)
    messages = [{"role": "user", "content": "Hello"}]
    render = functools.partial(tokenizer.apply_chat_template, tokenize=False)
    ours = render(messages, chat_template=template_file.read_text(), add_generation_prompt=True)
    checkpoint = render(messages, add_generation_prompt=True)
    assert ours == PREFIX + checkpoint
    reply = greedy_answer(server[0], "Hello", None)
    assert reply.usage.prompt_tokens == len(tokenizer(ours).input_ids)


def test_log_level_applies_to_mm_serve_and_uvicorn(server) -> None:
    """Once the server has answered, with ``--log-level warning`` neither our start-up lines
    nor uvicorn's ("Uvicorn running on ...") were logged."""
    url, log_path = server
    greedy_answer(url, "Hello", None)
    log = log_path.read_text()
    assert "Uvicorn running" not in log
    assert "INFO" not in log, log


@pytest.mark.parametrize(
    "args, code",
    [(["--no-such-flag"], 2), (["/no/such/model"], 1)],
    ids=["bad-flag", "missing-model"],
)
def test_serve_that_cannot_start_leaves_no_engine_core(args, code, tmp_path) -> None:
    """The console script starts the engine core before parsing ``serve``'s flags; when they
    are bad or the model is missing, the command fails and takes the process with it."""
    command = [sys.executable, "-m", "mm_serve.entrypoints.launch", "serve", *args]
    env = os.environ | {"TMPDIR": str(tmp_path)}  # where the engine core's ipc folder goes
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, env=env, start_new_session=True)
    assert proc.wait(60) == code, proc.stderr.read().decode()[-2000:]
    assert_group_gone(proc.pid)
    assert list(tmp_path.iterdir()) == []


def test_serve_keeps_bytecode_where_the_environment_writes_none(tmp_path) -> None:
    """With ``PYTHONDONTWRITEBYTECODE`` set, ``serve`` re-runs itself with bytecode kept in
    ``$MM_SERVE_CACHE_DIR/pycache`` (none beside the sources); ``MM_SERVE_PYCACHE=0`` opts out."""
    command = [sys.executable, "-m", "mm_serve.entrypoints.launch", "serve", "--no-such-flag"]
    for opt_out, cache in (("0", tmp_path / "off"), ("1", tmp_path / "on")):
        env = os.environ | {
            "PYTHONDONTWRITEBYTECODE": "1",
            "MM_SERVE_CACHE_DIR": str(cache),
            "MM_SERVE_PYCACHE": opt_out,
        }
        assert subprocess.run(command, env=env, capture_output=True).returncode == 2
    assert not (tmp_path / "off").exists()
    cached = {p.name for p in (tmp_path / "on" / "pycache").rglob("*.pyc")}
    assert f"cli.{sys.implementation.cache_tag}.pyc" in cached
