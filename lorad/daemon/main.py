"""`lorad`: parse flags, check the model folder, then run the coordinator on uvloop.

Everything that can be refused without starting a worker (flags, config.json, adapter folders,
tokenizer, chat template, --max-model-len) is refused here with one line and exit status 2.
`lorad check-adapter ...` is handed to lorad.config.check_adapter, `lorad keys` and `lorad node`
(several hosts) to keys_command.py and node.py.
"""

from __future__ import annotations

import logging
import sys

import uvloop

from lorad.config import ConfigError, ModelConfig, ServeConfig, check_adapter
from lorad.config.adapter_capacity import LoraCapacity
from lorad.config.adapters import load_registry
from lorad.config.cli import parse_args
from lorad.config.partition import check_parallel
from lorad.daemon import keys_command, node
from lorad.daemon.routes import ServedModel
from lorad.daemon.service import serve
from lorad.daemon.supervisor import WORKER_COMMAND
from lorad.daemon.token_bytes import TokenBytes
from lorad.daemon.tokenizer import ModelTokenizer
from lorad.protocol.curve import client_keys, server_keys


def main(argv: list[str] | None = None,
         worker_command: tuple[str, ...] = WORKER_COMMAND) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check-adapter"]:
        return check_adapter.main(argv[1:])
    if argv[:1] == ["keys"]:  # several hosts: the CURVE key files
        return keys_command.main(argv[1:])
    if argv[:1] == ["node"]:  # several hosts: another host's agent
        return node.main(argv[1:], load_served_model)
    config = parse_args(argv)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if config.cluster.multi_host:  # node 0 needs both: the coordinator's and its workers'
            server_keys(config.cluster.key_dir)
            client_keys(config.cluster.key_dir)
        model = load_served_model(config)
        return uvloop.run(serve(config, model, worker_command))
    except ConfigError as exc:  # a bad model folder, or no runtime directory could be made
        print(f"lorad: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the event loop took over the signal
        return 130


def check_slots(capacity: LoraCapacity, num_adapters: int, num_pinned: int) -> None:
    """Every adapter must be able to run: a slot at least, one not pinned for the others."""
    if capacity.num_slots == 0 and (num_adapters or capacity.runtime):
        raise ConfigError("--max-gpu-adapters 0: adapters need at least one device slot")
    if num_pinned >= capacity.num_slots and (num_adapters > num_pinned or capacity.runtime):
        raise ConfigError(f"--pin-adapter: {num_pinned} pinned adapters fill all "
                          f"{capacity.num_slots} device slots (--max-gpu-adapters), and the "
                          "other adapters could never run")


def load_served_model(config: ServeConfig) -> ServedModel:
    model = ModelConfig.from_dir(config.model_dir)
    check_parallel(model, config.parallel)
    # Adapter folders are checked against config.json alone, before anything else is read.
    adapters = load_registry(config.adapters, model, reserved_names=(config.served_name,))
    tokenizer = ModelTokenizer.from_dir(config.model_dir)
    limit = model.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ConfigError(f"--max-model-len {config.max_model_len} exceeds the model's "
                          f"max_position_embeddings ({limit})")
    stop_ids = model.eos_token_ids
    if tokenizer.eos_token_id is not None:
        stop_ids = tuple(dict.fromkeys(stop_ids + (tokenizer.eos_token_id,)))
    capacity = LoraCapacity.resolve([a.modules for a in adapters], config.runtime_adapters,
                                    config.max_gpu_adapters, config.max_lora_rank,
                                    config.lora_dtype, [a.name for a in adapters])
    check_slots(capacity, len(adapters), len(config.pinned_adapters))
    return ServedModel(name=config.served_name, tokenizer=tokenizer,
                       max_model_len=config.max_model_len or limit,
                       vocab_size=model.vocab_size, stop_token_ids=stop_ids, adapters=adapters,
                       token_bytes=TokenBytes.from_dir(config.model_dir), capacity=capacity,
                       model_config=model)


if __name__ == "__main__":
    sys.exit(main())
