# The two commands of the README's quick start: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tensorpar-installed

.PHONY: setup demo demo-layers demo-finetune demo-lora test bench clean

# Python keeps the bytecode it compiles (the packages install without it: scripts/setup_env.sh), whatever the shell says.
export PYTHONDONTWRITEBYTECODE=

$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)
	@touch $(STAMP)

setup: $(STAMP)

# The main job: train the tiny Llama-style preset at TP=2 on the embedded corpus (about 2-3 minutes on
# 2 CPU cores), then print a greedy sample; metrics and the loss curve go to runs/tiny-tp2/.
demo: $(STAMP)
	$(PY) -m tensorpar train --tp 2 --steps 600 --sample-tokens 200

# Chat fine-tuning on CPU (under a minute on 2 cores): 400 conversations asking for sums, a ChatML tokenizer folder,
# the loss on the assistant's turns only, WSD and Muon at TP=2; the greedy sample answers a question in the chat format.
demo-finetune: $(STAMP)
	$(PY) examples/finetune/make_chat_example.py runs/chat-example
	$(PY) -m tensorpar train --model runs/chat-example/model.json --tokenizer runs/chat-example/tokenizer \
		--data runs/chat-example/chat.jsonl --tp 2 --steps 150 --seq-len 128 --global-batch-size 16 \
		--lr-schedule wsd --optimizer muon --out-dir runs/chat-example/run --sample-tokens 12 \
		--sample-prompt "What is 3 plus 4?"

# LoRA on CPU (about a minute on 2 cores): the chat model of demo-finetune trained on sums answered in digits
# ("3 plus 4 is 7."), then a rank-8 LoRA adapter at TP=2 + SP teaching it to answer in words ("3 plus 4 is seven.")
# with the base frozen; each checkpoint holds a PEFT adapter folder (runs/lora-example/lora/step-000060/adapter),
# merged into a Hugging Face model at the end.
demo-lora: $(STAMP)
	$(PY) examples/finetune/make_chat_example.py runs/lora-example
	rm -rf runs/lora-example/base runs/lora-example/lora runs/lora-example/merged
	$(PY) -m tensorpar train --model runs/lora-example/model.json --tokenizer runs/lora-example/tokenizer \
		--data runs/lora-example/chat.jsonl --tp 2 --steps 100 --seq-len 128 --global-batch-size 16 \
		--lr-schedule wsd --optimizer muon --out-dir runs/lora-example/base-run --save runs/lora-example/base \
		--sample-tokens 12 --sample-prompt "What is 3 plus 4?"
	$(PY) -m tensorpar train --init-from runs/lora-example/base --tokenizer runs/lora-example/tokenizer \
		--data runs/lora-example/chat-words.jsonl --tp 2 --sequence-parallel --lora-rank 8 --lora-alpha 16 \
		--steps 60 --lr 1e-2 --seq-len 128 --global-batch-size 16 --out-dir runs/lora-example/lora-run \
		--save runs/lora-example/lora --sample-tokens 12 --sample-prompt "What is 3 plus 4?"
	$(PY) -m tensorpar convert runs/lora-example/lora runs/lora-example/merged --merge-lora

# The four TP building blocks on a toy model, rank by rank, with every collective counted.
demo-layers: $(STAMP)
	$(PY) -m tensorpar demo --tp 2

bench: $(STAMP)
	$(PY) bench/tp_step.py

# The whole suite on two pytest workers (a test file's tests stay on one worker, so that its module's fixtures, a
# server or a reference run, are built once); it ends with its 15 slowest tests, so that a test that grows shows at
# once. Python caches tensorpar's compiled modules: every rank a test starts imports them again.
test: $(STAMP)
	$(PY) -m pytest -q tests -n 2 --dist loadscope --durations=15

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
