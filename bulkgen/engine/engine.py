"""The engine: requests in, finished outputs out. A step reads as three calls:
schedule → run the model → post-process (sample, append, stop, free)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from bulkgen.config import EngineConfig, SamplingParams, format_size
from bulkgen.engine import sampler
from bulkgen.engine.block_manager import BlockManager
from bulkgen.engine.detokenizer import IncrementalDetokenizer, drop_incomplete_character
from bulkgen.engine.grammar import Constraints
from bulkgen.engine.loading import plan as plan_run
from bulkgen.engine.protocol import EngineStats, FinishReason, RequestOutput, StepRecord
from bulkgen.engine.runner import ModelRunner
from bulkgen.engine.scheduler import AdmissionPolicy, Scheduler, SchedulerOutput
from bulkgen.engine.sequence import Sequence, SequenceStatus
from bulkgen.engine.speculate import Drafter, Speculation
from bulkgen.errors import ConfigError, PromptTooLongError
from bulkgen.model import load_tokenizer


class Engine:
    def __init__(self, model: str | Path | torch.nn.Module, config: EngineConfig | None = None,
                 tokenizer: Any = None,
                 admission: Callable[[int, int], AdmissionPolicy] | None = None) -> None:
        """admission: builds the admission policy from the KV cache's (num_blocks, block_size, group_windows), e.g.
        packing.admission_for(packing); None admits whatever has blocks now."""
        plan = plan_run(model, config or EngineConfig())  # dtype and quantization resolved (auto: what fits)
        self.config = plan.config
        self.runner = ModelRunner(model, plan)
        hf_config = self.runner.model.config
        self.tokenizer = tokenizer or load_tokenizer(model if not isinstance(model, torch.nn.Module)
                                                     else hf_config._name_or_path)
        self.max_model_len = self.runner.max_model_len
        self.runner.prepare_run()
        layout = self.runner.layout
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching, layout, self.runner.kv.null_block)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   None if admission is None else admission(self.runner.num_blocks,
                                                                            self.config.block_size,
                                                                            layout.group_windows))
        self.eos_token_ids = _eos_ids(self.runner.model, self.tokenizer)
        self.stats = EngineStats()
        self._seqs: dict[Any, Sequence] = {}
        self.constraints = Constraints(self.tokenizer, hf_config.vocab_size, overlap=self.runner.device.type != "cpu",
                                       kernel=self.runner.ops.mask_tokens)
        self.speculation = Speculation(self.config.speculate)
        self.drafter = Drafter(self.speculation, self.tokenizer, self.eos_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Tokens the KV cache holds."""
        return self.runner.max_num_tokens

    def describe(self) -> str:
        """One line: the model, dtype and device, each CPU kernel family's path, the KV cache."""
        runner = self.runner
        name = Path(str(runner.model.config._name_or_path)).name or type(runner.model).__name__
        paths = f" · {runner.paths.short()}" if runner.device.type == "cpu" else ""
        layout = runner.layout
        windows = sorted({w for w in layout.group_windows if w})
        sliding = f"; sliding layers hold their window of {', '.join(map(str, windows))}" if windows else ""
        weights = {"int8": " · int8 weights (W8A8)", "gguf": f" · GGUF blocks ({runner.weight_kinds()})"}.get(
            self.config.quantization, "")
        return (f"model {name} · {self.config.dtype}{weights} on {runner.device}{paths} · KV cache "
                f"{format_size(runner.kv_cache_bytes)} ({runner.max_num_tokens:,} tokens{sliding})")

    def add(self, request_id: Any, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Queue a request. Raises PromptTooLongError if it cannot fit the model or the KV cache."""
        params = params or SamplingParams()
        if request_id in self._seqs:
            raise ConfigError(f"request id {request_id!r} is already in the engine")
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise PromptTooLongError("the prompt is empty: give at least one token")
        if num_prompt >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {num_prompt} tokens; the model's context is "
                                     f"{self.max_model_len} tokens, which must also hold the output")
        needed = min(num_prompt + params.max_new_tokens, self.max_model_len)
        if self.block_manager.most_blocks(needed, self.config.max_num_batched_tokens) > self.block_manager.num_blocks:
            raise PromptTooLongError(f"the request needs up to {needed} tokens of KV cache; the cache holds "
                                     f"{self.runner.max_num_tokens}: raise --kv-cache-memory")
        seq = Sequence(request_id, list(prompt_token_ids), params)
        if params.stop:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.stop)
        if params.json_schema is not None:
            seq.matcher = self.constraints.matcher(params.json_schema)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished(self) -> int:
        return len(self._seqs)

    def abort(self, request_id: Any) -> RequestOutput | None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return self._finish_output(seq)

    def abort_waiting(self) -> list[RequestOutput]:
        """Abort every request that has not started computing (a draining worker gives them back)."""
        waiting = [seq for seq in self.scheduler.waiting if seq.num_computed_tokens == 0]
        return [out for seq in waiting if (out := self.abort(seq.request_id)) is not None]

    def step(self) -> list[RequestOutput]:
        """One engine step: schedule, run the model, post-process. Returns the requests that finished."""
        began = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        masks = self.constraints.begin(scheduled.scheduled)  # JSON schemas' masks (grammar.py)
        self.runner.kv.copy_blocks(self.block_manager.take_copies())  # partly shared prefixes' blocks
        logits, sampled_seqs = self.runner.execute(scheduled.scheduled)
        masks.apply(logits, sampled_seqs)
        finished = self._postprocess(scheduled, logits, sampled_seqs)
        self.speculation.observe_step(scheduled.num_batched_tokens, len(sampled_seqs), time.perf_counter() - began)
        self.drafter.propose(self.scheduler.running, self._room)  # the next step's drafts (speculate.py)
        return finished

    def generate(self, prompts: Iterable[list[int] | str], params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> Iterator[RequestOutput]:
        """Run prompts (token ids or text) to completion; yields outputs in completion order, with
        `request_id` the prompt's index."""
        prompts = list(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            ids = prompt if not isinstance(prompt, str) else self.tokenizer(prompt)["input_ids"]
            self.add(i, ids, p)
        while self.has_unfinished():
            yield from self.step()

    def _postprocess(self, scheduled: SchedulerOutput, logits: torch.Tensor,
                     sampled_seqs: list[Sequence]) -> list[RequestOutput]:
        """Sample each row; keep each draft as far as its rows' tokens agree with it (the row after its last kept
        token gives the sequence's next token); advance the sequences; append, stop and free."""
        now = time.monotonic()
        self.stats.num_running, self.stats.kv_usage = len(scheduled.scheduled), self.block_manager.usage
        num_decodes = 0
        for s in scheduled.scheduled:
            num_decodes += s.num_new_tokens == 1
            own = s.num_new_tokens - s.num_draft_tokens
            if s.seq.num_output_tokens == 0 or own > 1:
                self.stats.num_prompt_tokens_computed += own
        generators = self._generators(sampled_seqs)
        result = sampler.sample(logits, sampled_seqs, self.eos_token_ids, self.runner.ops.argmax,
                                self.runner.ops.candidates, generators)
        # each sampled sequence's rows: (first row, its draft's tokens kept)
        rows: list[tuple[Sequence, int, int]] = []
        rejected: dict[int, int] = {}
        i = 0
        while i < len(sampled_seqs):
            seq = sampled_seqs[i]
            draft = seq.draft
            kept = 0
            while kept < len(draft) and result.errors[i + kept] is None and result.token_ids[i + kept] == draft[kept]:
                kept += 1
            if draft:
                self.drafter.verified(seq, len(draft), kept)
                rejected[id(seq)] = len(draft) - kept
                seq.token_ids.extend(draft[:kept])  # computed this step: the prefix cache may take their blocks
            rows.append((seq, i, kept))
            i += 1 + len(draft)
        self.scheduler.update(scheduled, rejected)
        finished = []
        sampled_at = time.monotonic()  # a request's first token and its end read one clock: TTFT <= latency
        for seq, first, kept in rows:
            tokens = result.token_ids[first:first + kept + 1]
            if kept:  # the kept draft tokens join the output one by one, checked as any token is
                del seq.token_ids[-kept:]
            status = None
            for j, token in enumerate(tokens):
                if result.errors[first + j] is not None:
                    seq.error = result.errors[first + j]
                    status = SequenceStatus.FINISHED_ERROR
                    break
                seq.append_token(token, sampled_at)
                status = self._check(seq, token, result.logprobs[first + j])
                if status is not None:
                    break
            if status is not None:
                seq.finish_time = sampled_at
                self.scheduler.finish(seq, status)
                self.drafter.finished(seq, status != SequenceStatus.FINISHED_ERROR)
                finished.append(self._finish_output(seq))
        self.stats.num_steps += 1
        self.stats.num_draft_tokens = self.drafter.num_drafted
        self.stats.num_accepted_tokens = self.drafter.num_accepted
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if self.stats.keep_steps:
            self.stats.steps.append(StepRecord(now, scheduled.num_batched_tokens, num_decodes,
                                               len(scheduled.scheduled), self.block_manager.usage,
                                               len(scheduled.preempted),
                                               sum(s.seq.num_computed_tokens for s in scheduled.scheduled)))
        return finished

    def _generators(self, sampled_seqs: list[Sequence]) -> list[torch.Generator | None]:
        """Each row's generator, seeded for the position it samples (Sequence.draw_seed): a drafted sequence's
        rows sample its next positions in turn."""
        generators: list[torch.Generator | None] = []
        previous, j = None, 0
        for seq in sampled_seqs:
            j = j + 1 if seq is previous else 0
            previous = seq
            if seq.params.is_greedy:
                generators.append(None)
                continue
            while len(seq.generators) <= j:
                seq.generators.append(torch.Generator(device=self.runner.device))
            generators.append(seq.generators[j].manual_seed(seq.draw_seed(seq.num_tokens + j)))
        return generators

    def _room(self, seq: Sequence) -> int:
        """Tokens a sequence may still add before its budget or the model's context ends it."""
        return min(seq.params.max_new_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)

    def _check(self, seq: Sequence, token: int, logprob: Any) -> SequenceStatus | None:
        """After a token joined the output: count it, feed its grammar; return the finish status if the sequence
        is done."""
        self.stats.num_output_tokens += 1
        if seq.logprobs is not None:
            seq.logprobs.append(logprob)
        params = seq.params
        if seq.matcher is not None:
            if not seq.matcher.consume_token(token) and token not in self.eos_token_ids:
                seq.error = f"the output left its JSON schema: {seq.matcher.get_error() or 'token refused'}"
                return SequenceStatus.FINISHED_ERROR
            if seq.matcher.is_stopped() and token not in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED  # the JSON is complete
        if token in params.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if token in self.eos_token_ids and not params.ignore_eos:
            return SequenceStatus.FINISHED_EOS
        if seq.detokenizer is not None and seq.detokenizer.push(token) is not None:
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= params.max_new_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _finish_output(self, seq: Sequence) -> RequestOutput:
        del self._seqs[seq.request_id]
        detok = seq.detokenizer
        stop_at = None
        if detok is not None and seq.status == SequenceStatus.FINISHED_STOPPED:
            found = [i for i in (detok.text.find(s) for s in seq.params.stop) if i >= 0]
            stop_at = min(found) if found else None
        error = seq.error
        if stop_at is not None:
            text = detok.text[:stop_at]
        else:
            try:
                text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            except Exception as exc:  # a tokenizer can fail on ids it does not know
                text, error = "", f"could not decode the output tokens: {exc}"
                seq.status = SequenceStatus.FINISHED_ERROR
            if seq.status == SequenceStatus.FINISHED_LENGTH:
                text = drop_incomplete_character(text)
        end = seq.finish_time or time.monotonic()
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, output_token_ids=seq.output_token_ids,
            text=text, finish_reason=seq.finish_reason or FinishReason.ABORT, num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions, logprobs=seq.logprobs, error=error,
            time_to_first_token_s=(seq.first_token_time - seq.arrival_time) if seq.first_token_time else None,
            latency_s=end - seq.arrival_time,
        )


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    """The ids that end generation, as Hugging Face generate() takes them: the generation config's first."""
    generation = getattr(model, "generation_config", None)
    for source in (getattr(generation, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            return frozenset([source])
        if isinstance(source, (list, tuple)) and source:
            return frozenset(int(i) for i in source)
    return frozenset()
