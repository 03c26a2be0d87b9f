#!/usr/bin/env python3
"""A verl reward function as a Sluice env server (Python standard library only).

verl scores a reply with a Python function
`compute_score(data_source, solution_str, ground_truth, extra_info=None)` that returns a number
or a dict holding `score`. This server speaks Sluice's remote env protocol (docs/envs.md,
"Protocol") around such a function: each episode opens with the row's prompt (verl's `prompt`
column: chat messages, or a string), takes one reply, and answers with the function's score as
the reward. Point a domain at it and keep your function as it is:

    python3 examples/verl_reward_server.py --port 8090 \
        --reward-file my_reward.py --reward-name compute_score

    [data.domains.gsm8k]
    env_url = "http://127.0.0.1:8090"
    task = "verl"                   # the one task this server serves

Without --reward-file, a GSM8K-style check scores the reply: 1 when the number after its last
`####` equals `reward_model.ground_truth` as a number, else 0. With $SLUICE_ENV_TOKEN set,
every call must carry `Authorization: Bearer <token>`, as Sluice's own env server requires
beyond loopback.

A row without its prompt or its answer field fails its episode (`env_bad_input`, naming the
field) rather than scoring 0, so a mistyped --answer-key stops a run instead of training it on
zeros. At most 10,000 episodes stay open: an episode its caller abandoned (a run that crashed
before deleting it) is dropped, oldest first.
"""

import argparse
import importlib.util
import itertools
import json
import os
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TASK = "verl"
MAX_BODY = 2 * 1024 * 1024
MAX_OPEN = 10_000


def gsm8k_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 when the number after the reply's last `####` equals the ground truth, else 0.0."""
    found = re.findall(r"####\s*(-?[\d,]*\.?\d+)", solution_str or "")
    if not found:
        return 0.0
    answer, truth = found[-1].replace(",", ""), str(ground_truth).replace(",", "").strip()
    try:
        return 1.0 if abs(float(answer) - float(truth)) <= 1e-9 * max(1.0, abs(float(truth))) else 0.0
    except ValueError:  # a ground truth that is not a number: compare the text
        return 1.0 if answer == truth else 0.0


def load_reward(path, name):
    spec = importlib.util.spec_from_file_location("reward_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def field(row, path):
    """The row's `path`: the key itself, else a dotted path through nested objects."""
    if path in row:
        return row[path]
    value = row
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


class ProtocolError(Exception):
    def __init__(self, status, kind, message):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class Envs:
    """Open episodes by id: their sample, and whether init and the reply came."""

    def __init__(self, score, prompt_key, answer_key):
        self.score, self.prompt_key, self.answer_key = score, prompt_key, answer_key
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.open = {}

    def create(self, body):
        if body.get("task") != TASK:
            raise ProtocolError(404, "unknown_task", f"this server serves only `{TASK}`")
        sample = body.get("sample")
        if not isinstance(sample, dict) or not isinstance(sample.get("input"), dict):
            raise ProtocolError(400, "bad_request", "expected {task, sample} with an object input")
        with self.lock:
            while len(self.open) >= MAX_OPEN:  # abandoned episodes go first (oldest first)
                self.open.pop(next(iter(self.open)))
            env_id = f"e{next(self.ids)}"
            self.open[env_id] = {"sample": sample, "state": "new"}
        return 201, {"env_id": env_id}

    def get(self, env_id):
        with self.lock:
            env = self.open.get(env_id)
        if env is None:
            raise ProtocolError(404, "unknown_env", f"no env `{env_id}`")
        return env

    def init(self, env_id):
        env = self.get(env_id)
        if env["state"] != "new":
            raise ProtocolError(409, "env_protocol", "init once, before any step")
        row = env["sample"]["input"]
        sample_id = env["sample"].get("id")
        prompt = field(row, self.prompt_key)
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str) for m in prompt
        ) and prompt[-1]["role"] == "user":
            messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        else:
            raise ProtocolError(
                400,
                "env_bad_input",
                f"sample `{sample_id}`: `{self.prompt_key}` must be a string or chat messages "
                "(system, user, assistant; text content) ending with the user's",
            )
        if field(row, self.answer_key) is None:
            raise ProtocolError(400, "env_bad_input", f"sample `{sample_id}` has no `{self.answer_key}`")
        env["state"] = "open"
        return 200, {"messages": messages}

    def step(self, env_id, body):
        env = self.get(env_id)
        if env["state"] != "open":
            raise ProtocolError(409, "env_protocol", "step after init, once")
        message = body.get("message") or {}
        row = env["sample"]["input"]
        try:
            result = self.score(
                row.get("data_source", env["sample"].get("dataset")),
                message.get("content") or "",
                field(row, self.answer_key),
                row.get("extra_info"),
            )
            reward = float(result["score"] if isinstance(result, dict) else result)
        except Exception as e:  # the reward function's own failure fails this rollout only
            raise ProtocolError(500, "env_failed", f"reward function: {e!r}")
        env["state"] = "done"
        return 200, {"reward": reward, "done": True, "situation": "answer"}

    def delete(self, env_id):
        with self.lock:
            self.open.pop(env_id, None)
        return 204, None


def handler(envs, token):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def reply(self, status, body):
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            if body is not None:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def route(self, method):
            try:
                if token and self.headers.get("Authorization") != f"Bearer {token}":
                    raise ProtocolError(401, "unauthorized", "a bearer token is required")
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    raise ProtocolError(400, "bad_request", "Content-Length is not a number")
                if length < 0 or length > MAX_BODY:
                    raise ProtocolError(413, "bad_request", "body over 2 MB")
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else {}
                except ValueError:
                    raise ProtocolError(400, "bad_request", "the body is not JSON")
                if not isinstance(body, dict):
                    raise ProtocolError(400, "bad_request", "the body is not a JSON object")
                parts = [p for p in self.path.split("/") if p]
                if method == "GET" and parts == ["v1", "health"]:
                    return self.reply(200, {"status": "ok", "envs": len(envs.open)})
                if method == "GET" and parts == ["v1", "tasks"]:
                    return self.reply(200, {"tasks": [TASK]})
                if method == "POST" and parts == ["v1", "envs"]:
                    return self.reply(*envs.create(body))
                if len(parts) == 4 and parts[:2] == ["v1", "envs"] and method == "POST":
                    if parts[3] == "init":
                        return self.reply(*envs.init(parts[2]))
                    if parts[3] == "step":
                        return self.reply(*envs.step(parts[2], body))
                if len(parts) == 3 and parts[:2] == ["v1", "envs"] and method == "DELETE":
                    return self.reply(*envs.delete(parts[2]))
                raise ProtocolError(404, "unknown_route", f"{method} {self.path}")
            except ProtocolError as e:
                if e.status in (400, 413):
                    self.close_connection = True  # the body may be unread
                self.reply(e.status, {"error": {"kind": e.kind, "message": e.message}})

        def do_GET(self):
            self.route("GET")

        def do_POST(self):
            self.route("POST")

        def do_DELETE(self):
            self.route("DELETE")

    return Handler


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090, help="0 picks a free one")
    parser.add_argument("--reward-file", help="a Python file defining the reward function")
    parser.add_argument("--reward-name", default="compute_score")
    parser.add_argument("--prompt-key", default="prompt", help="the row field holding the prompt")
    parser.add_argument(
        "--answer-key", default="reward_model.ground_truth", help="the row field holding the answer"
    )
    args = parser.parse_args()
    score = load_reward(args.reward_file, args.reward_name) if args.reward_file else gsm8k_score
    token = os.environ.get("SLUICE_ENV_TOKEN")
    envs = Envs(score, args.prompt_key, args.answer_key)
    server = ThreadingHTTPServer((args.host, args.port), handler(envs, token))
    host, port = server.server_address[:2]
    print(f"verl reward server listening on http://{host}:{port} (task: {TASK})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
