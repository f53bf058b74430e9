# The two commands of the README's quick start: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tensorpar-installed

.PHONY: setup demo demo-layers demo-finetune test bench clean

$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)
	@touch $(STAMP)

setup: $(STAMP)

# The main job: train the tiny Llama-style preset at TP=2 on the embedded corpus (about 2-3 minutes on
# 2 CPU cores), then print a greedy sample; metrics and the loss curve go to runs/tiny-tp2/.
demo: $(STAMP)
	$(PY) -m tensorpar train --tp 2 --steps 600 --sample-tokens 200

# Chat fine-tuning on CPU (about 2 minutes): 400 conversations asking for sums, a ChatML tokenizer folder, the loss on
# the assistant's turns only, WSD and Muon at TP=2; the greedy sample answers a question in the chat format.
demo-finetune: $(STAMP)
	$(PY) examples/finetune/make_chat_example.py runs/chat-example
	$(PY) -m tensorpar train --model runs/chat-example/model.json --tokenizer runs/chat-example/tokenizer \
		--data runs/chat-example/chat.jsonl --tp 2 --steps 150 --seq-len 128 --global-batch-size 16 \
		--lr-schedule wsd --optimizer muon --out-dir runs/chat-example/run --sample-tokens 12 \
		--sample-prompt "What is 3 plus 4?"

# The four TP building blocks on a toy model, rank by rank, with every collective counted.
demo-layers: $(STAMP)
	$(PY) -m tensorpar demo --tp 2

bench: $(STAMP)
	$(PY) bench/tp_step.py

# The whole suite; it ends with its 15 slowest tests, so that a test that grows shows at once.
test: $(STAMP)
	$(PY) -m pytest -q tests --durations=15

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
