"""The demo model (SmolLM2-135M-Instruct, fp32, CPU) at --parallel 2 across two "hosts" gives
the same greedy chat output, token for token, as --parallel 2 on one host, with the prompts sent
together so that the planner batches them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.daemons import post, start_daemon, wait_healthy
from tests.integration.cluster_hosts import start_cluster

pytestmark = pytest.mark.slow

NAME = "SmolLM2-135M-Instruct"
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
           "Give me three tips for staying focused while studying.")
FLAGS = ("--name", NAME, "--dtype", "float32", "--device", "cpu", "--max-model-len", "2048",
         "--kv-cache-blocks", "256")


def _greedy_chats(url: str) -> list[tuple[str, list[int]]]:
    """Each prompt's (text, completion token ids), sent at once."""
    def chat(prompt: str):
        status, body = post(f"{url}/v1/chat/completions", {
            "model": NAME, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 24, "temperature": 0, "logprobs": True})
        assert status == 200, body
        choice = body["choices"][0]
        return (choice["message"]["content"],
                [entry["token"] for entry in choice["logprobs"]["content"]])
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(chat, PROMPTS))


def test_two_hosts_equal_one_host_on_the_demo_model(tmp_path, demo_model_dir):
    one_host = start_daemon(demo_model_dir, "--parallel", "2", *FLAGS, wait=False)
    try:
        wait_healthy(one_host, timeout_s=300)
        expected = _greedy_chats(one_host.url)
        assert all(len(ids) >= 8 for _, ids in expected), expected  # "Paris." and its EOS
    finally:
        assert one_host.stop() == 0, one_host.log()[-3000:]
    cluster = start_cluster(tmp_path, demo_model_dir, *FLAGS)
    try:
        assert _greedy_chats(cluster.coordinator.url) == expected
        assert cluster.coordinator.stop() == 0
        assert cluster.node.proc.wait(30) == 0, cluster.node.log()[-3000:]
    finally:
        cluster.kill()
