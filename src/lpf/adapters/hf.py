"""`hf` engine: Hugging Face transformers `generate`, batched and left-padded.

Records the raw (pre-temperature, pre-top-k/top-p) logprob of every sampled token from
`output_logits`, plus the top-k. Batches are formed from requests sorted by prompt length (less
padding); each batch seeds torch's generator from its first request, so a run is reproducible for a
fixed batching. Generation settings are passed explicitly and the model's own `generation_config` is replaced by a
neutral one, so nothing is inherited from it (a repetition penalty there would make the "engine"
disagree with the reference; its EOS would stop an `ignore_eos` run).
Prompt logprobs (`--prompt-logprobs`) come from one forward over the same left-padded, masked batch
generate's prefill sees (rows of a few requests at a time, so [rows, width, vocab] logits stay small).
"""

from __future__ import annotations

import inspect
import time
from typing import Iterator, Literal

from lpf.core.knobs import knob
from lpf.adapters.base import Completion, Engine, Options
from lpf.core.workload import EngineRequest


class HFOptions(Options):
    batch_size: int = knob(
        32,
        ge=1,
        help="Requests generated together (one padded generate() batch).",
        roles=("concurrency",),
        shrink_order=100,
    )
    dtype: Literal["float32", "bfloat16", "float16"] = knob(
        "float32", help="Engine dtype: float32, bfloat16 or float16.", shrink_order=130, flag=True
    )
    device: str = knob("cpu", help="Where the model runs (cpu, cuda).")


class HFEngine(Engine):
    name = "hf"
    Options = HFOptions
    supports_prompt_logprobs = True
    locate_replay = "lpf.locate.replays:hf"  # its decode path alone
    kept_worker = True
    PROMPT_LOGIT_ELEMENTS = 1 << 25  # float32 logits held at once by the prompt forward (128 MB)

    def __init__(self, model, sampling, options: HFOptions):
        super().__init__(model, sampling, options)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from lpf.core.torch_utils import quiet_transformers, torch_dtype

        quiet_transformers()
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model.path)
        self.hf_model = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch_dtype(options.dtype))
        self.hf_model.to(options.device).eval()
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        self.eos_id = self.tokenizer.eos_token_id
        from transformers import GenerationConfig

        # generate() fills every unset field from the model's generation_config (an eos_token_id of
        # None would silently become the model's EOS): replace it with a neutral one.
        self.hf_model.generation_config = GenerationConfig(
            pad_token_id=self.pad_id,
            bos_token_id=self.tokenizer.bos_token_id,
            eos_token_id=None if sampling.ignore_eos else self.eos_id,
        )

    def describe(self) -> dict:
        import transformers

        return {"name": self.name, "version": transformers.__version__, "options": self.options.to_dict()}

    def configuration(self) -> dict:
        cfg = self.hf_model.config
        via = "transformers model config"
        impl = getattr(cfg, "_attn_implementation", None)
        quant = getattr(cfg, "quantization_config", None)
        out = {
            "dtype": (self.options.dtype, f"{via}: the dtype lpf loaded it in"),
            "kv_cache_dtype": (self.options.dtype, f"{via}: transformers' cache holds the model's dtype"),
            "weight_quantization": (str(quant) if quant else "none", f"{via} quantization_config"),
            # generate() runs with a neutral GenerationConfig: no model defaults inherited
            "sampling_defaults": ({}, "lpf's neutral GenerationConfig"),
        }
        if impl == "eager" or (impl and "flash" in impl):  # sdpa picks its own kernel: not said
            out["flash_attention"] = ("on" if "flash" in impl else "off", f"{via} attn_implementation {impl}")
        return out

    def generate(self, requests: list[EngineRequest]) -> Iterator[Completion]:
        order = sorted(requests, key=lambda r: (len(r.prompt_token_ids), r.seq))
        bs = max(1, self.options.batch_size)
        for i in range(0, len(order), bs):
            yield from self._batch(order[i : i + bs])

    def _batch(self, batch: list[EngineRequest]) -> Iterator[Completion]:
        torch = self._torch
        from transformers import GenerationConfig

        from lpf.core.torch_utils import logprob_rows

        t0 = time.time()
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids) :] = 1
        s = self.sampling
        cfg = GenerationConfig(
            max_new_tokens=max(r.max_tokens for r in batch),
            do_sample=not s.greedy,
            temperature=s.temperature if not s.greedy else None,
            top_p=s.top_p if not s.greedy else None,
            top_k=s.top_k if not s.greedy else None,
            pad_token_id=self.pad_id,
            eos_token_id=None if s.ignore_eos else self.eos_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        torch.manual_seed(batch[0].seed)
        dev = self.options.device
        with torch.inference_mode():
            out = self.hf_model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), generation_config=cfg)
        prompt = self._prompt_logprobs(ids, mask, batch) if s.prompt_logprobs else None
        new = out.sequences[:, width:].cpu()
        steps = len(out.logits)
        # Per step, all rows at once: [B, V] logits are small; never stack [steps, B, V].
        per_step = [logprob_rows(out.logits[t], new[:, t].to(out.logits[t].device), s.logprobs) for t in range(steps)]
        t1 = time.time()
        for row, r in enumerate(batch):
            toks = new[row].tolist()
            n = min(r.max_tokens, steps)
            finish = "length"
            if not s.ignore_eos and self.eos_id in toks[:n]:
                n = toks.index(self.eos_id) + 1  # the stop token is output too, as vLLM reports it
                finish = "stop"
            yield Completion(
                request_id=r.request_id,
                output_token_ids=toks[:n],
                logprobs=[float(per_step[t][0][row]) for t in range(n)],
                topk_ids=[per_step[t][1][row, : s.logprobs].tolist() for t in range(n)],
                topk_logprobs=[per_step[t][2][row, : s.logprobs].tolist() for t in range(n)],
                finish_reason=finish,
                t_submit=t0,
                t_first_token=None,
                t_finish=t1,
                prompt_logprobs=prompt[row][0] if prompt else None,
                prompt_topk_ids=prompt[row][1] if prompt else [],
                prompt_topk_logprobs=prompt[row][2] if prompt else [],
            )

    def _prompt_logprobs(self, ids, mask, batch: list[EngineRequest]) -> list[tuple[list, list, list]]:
        """Per request (logprobs, top-k ids, top-k logprobs) of prompt positions 1..P-1, from the
        left-padded batch as generate's prefill runs it."""
        torch = self._torch
        from lpf.core.torch_utils import logprob_rows

        k, dev, width = self.sampling.logprobs, self.options.device, ids.shape[1]
        vocab = self.hf_model.get_output_embeddings().weight.shape[0]
        step = max(1, self.PROMPT_LOGIT_ELEMENTS // max(1, width * vocab))
        # the positions generate's prefill gives a left-padded row (count from its first real token),
        # for models whose forward takes them (pure state-space models have none)
        takes_positions = "position_ids" in inspect.signature(self.hf_model.forward).parameters
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = []
        for lo in range(0, len(batch), step):
            extra = {"position_ids": positions[lo : lo + step].to(dev)} if takes_positions else {}
            with torch.inference_mode():
                logits = self.hf_model(
                    input_ids=ids[lo : lo + step].to(dev), attention_mask=mask[lo : lo + step].to(dev), **extra
                ).logits
            for row, r in enumerate(batch[lo : lo + step]):
                p = len(r.prompt_token_ids)
                if p < 2:
                    out.append(([], [], []))
                    continue
                targets = torch.tensor(r.prompt_token_ids[1:], device=logits.device)
                chosen, top_ids, top_lp, _, _ = logprob_rows(logits[row, width - p : width - 1], targets, k)
                out.append((chosen.tolist(), top_ids[:, :k].tolist(), top_lp[:, :k].tolist()))
            del logits
        return out
