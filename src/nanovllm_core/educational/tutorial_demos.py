"""The tutorial's live demonstrations, run on the real engine for the CLI's ``--tutorial``.

The model is loaded once; each demonstration builds a fresh small engine over the same
weights with the settings its :class:`~nanovllm_core.educational.tutorial.Demo` asks for
(``Demo.engine``), sends its requests, and prints the narrator's entries of the kinds the
demo is about. The attention demonstration also prints X-Ray's full view of layer 0, and a
demonstration about the roofline its step's intensity against this machine's ridge point.
The app's Tutorial tab builds its demonstration engines the same way (:meth:`EngineDemos.engine`).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text

from nanovllm_core import events as ev
from nanovllm_core.educational import speculative_costs, tp_facts
from nanovllm_core.educational.commentary import Commentary, weights_label
from nanovllm_core.educational.narrate_view import NarrateView
from nanovllm_core.educational.rich_parts import Indent
from nanovllm_core.educational.tp_facts import SPLIT_UNAVAILABLE, communication_words, split_engine_available
from nanovllm_core.educational.tutorial import DEMOS, Chapter, engine_settings_text
from nanovllm_core.educational.xray import engine_roofline
from nanovllm_core.educational.xray_facts import roofline_commentary
from nanovllm_core.educational.xray_view import render_layer_detail
from nanovllm_core.host_load import HostCheck

DEMO_KV_BLOCKS = 64  # a demo's pool when its settings do not size one: small and quick to allocate


def engine_heading(info: dict[str, Any], speculative: str = "", k: int = 0) -> str:
    """The line naming the engine a demonstration's numbers come from (``info``: its ``model_info()``): "On its
    own engine over the loaded model: 64 KV blocks of 16 tokens, ...". A split engine is not over the loaded
    model: each rank loads its own shard, and as float weights (this engine splits float layers only), so
    it says so (trial 34e: "over the loaded model" of ranks running float32 beside a Q4_1 GGUF)."""
    split = tp_facts.tp_size(info)
    label = weights_label(info)
    where = (f"On its own engine split over {split} ranks, each loading its shard of the model as "
             f"{info.get('dtype', 'float')} weights{f' ({label})' if label else ''}: " if split > 1
             else "On its own engine over the loaded model: ")
    return where + engine_settings_text(info, speculative, k) + "."


class EngineDemos:
    """Loads the model on :meth:`load` and runs chapters' demonstrations (callable as a ``DemoRunner``).

    Args:
        model, device, dtype, quantization: as for ``LLM`` (None: the embedded default, the best
            device, its dtype, float weights).

    Raises (from :meth:`load`):
        ModelLoadError: the model cannot be loaded (one line).
    """

    def __init__(self, model: str | None = None, device: str | None = None, dtype: str | None = None,
                 quantization: str | None = None) -> None:
        self.model, self.device, self.dtype, self.quantization = model, device, dtype, quantization
        self._loaded: tuple[Any, Any, Any] | None = None

    @classmethod
    def from_loaded(cls, model: Any, tokenizer: Any, resolved: Any, device: str | None = None,
                    dtype: str | None = None) -> "EngineDemos":
        """Demonstrations over a model already loaded (``load_model``'s result), e.g. shared by tests;
        its quantization is the one its layers were built with.

        Raises:
            ValueError: ``model`` is one rank's shard of a split engine (``model.tp.world_size`` > 1): it is
                not the whole model, and its all-reduces belong to that engine's process group, whose other
                ranks would never join a demonstration's steps (the group's timeout would then kill the
                split engine: trial 17b). Nothing is touched.
        """
        tp = getattr(model, "tp", None)
        ranks = getattr(tp, "world_size", 1)
        if isinstance(ranks, int) and ranks > 1:
            raise ValueError(f"No demonstration over rank {getattr(tp, 'rank', 0)}'s shard of a model split over "
                             f"{ranks} ranks: a demonstration needs the whole model, and this shard's all-reduces "
                             "belong to its engine's process group; run `nanovllm --tutorial` in a terminal")
        self = cls(None, device, dtype, getattr(model, "quantization", None))
        self._loaded = (model, tokenizer, resolved)
        return self

    def load(self) -> dict[str, Any]:
        """Load the weights (once) and return the model's facts (``LLMEngine.model_info()``)."""
        if self._loaded is None:
            from nanovllm_core.config import EngineConfig
            from nanovllm_core.llm import close_progress, console_progress
            from nanovllm_core.model.loader import load_model

            cfg = EngineConfig(model=self.model, device=self.device, dtype=self.dtype, quantization=self.quantization)
            progress = console_progress()
            try:
                self._loaded = load_model(cfg.model, cfg.torch_device, cfg.torch_dtype, progress=progress,
                                          quantization=cfg.quantization)
            finally:  # a failed load's error line must not start on a half-drawn bar
                close_progress(progress)
        engine = self.engine()
        engine_roofline(engine)  # once per machine (and block kernel): the prefill and decode chapters' facts
        return engine.model_info()

    def engine(self, **settings: Any):
        """A new engine over the loaded model with these ``EngineConfig`` settings.

        Raises:
            ValueError: a setting this build's ``EngineConfig`` does not have (one line naming it),
                or one it refuses.
        """
        from nanovllm_core.config import EngineConfig
        from nanovllm_core.engine.llm_engine import LLMEngine

        if "tensor_parallel_size" in settings and not split_engine_available():
            raise ValueError(SPLIT_UNAVAILABLE[0].upper() + SPLIT_UNAVAILABLE[1:])
        if settings.get("tensor_parallel_size", 1) > 1:
            # A split engine starts its own worker processes, and every rank (this one too) loads
            # its own shard: it cannot reuse the loaded whole model. Float weights (auto under N > 1).
            settings.setdefault("num_kv_blocks", DEMO_KV_BLOCKS)
            return LLMEngine.from_config(EngineConfig(model=self.model, device=self.device, dtype=self.dtype,
                                                      **settings))
        if self._loaded is None:
            self.load()
        settings.setdefault("num_kv_blocks", DEMO_KV_BLOCKS)
        model, tokenizer, resolved = self._loaded
        config = EngineConfig(model=self.model, device=self.device, dtype=self.dtype, quantization=self.quantization,
                              **settings)
        return LLMEngine(config, model, tokenizer, resolved)

    def __call__(self, chapter: Chapter, console: Console) -> None:
        """Run ``chapter``'s demonstration and print what it shows."""
        from nanovllm_core.llm import LLM

        demo = DEMOS[chapter.demo]
        if demo.allreduce_ranks:
            if not self._communication(demo, chapter, console):
                return
        engine = self.engine(**demo.engine_settings())
        spec = getattr(engine, "speculator", None)
        try:  # the engine the numbers below come from (the app's Tutorial tab says the same)
            console.print(Indent(Text(engine_heading(engine.model_info(), spec.name if spec is not None else "",
                                                     spec.k if spec is not None else 0), style="dim")))
        except KeyError:  # an engine that does not report a size: nothing claimed
            pass
        view = NarrateView(console, engine.model_info(), max_decode_steps=None, kinds=demo.kinds,
                           kv_every_step=demo.kv_every_step)
        layer0: list[ev.LayerTrace] = []

        def keep_layer0(e: ev.Event) -> None:
            if isinstance(e, ev.LayerTrace) and e.layer == 0 and not layer0:
                layer0.append(e)

        engine.subscribe(view, topk=5, blocks=True, xray=demo.xray)
        if demo.xray:
            engine.select_xray(None, layer=0, head=0)
            engine.subscribe(keep_layer0, topk=0, blocks=False, xray=True)
        llm = LLM.from_engine(engine)
        requests = demo.requests(chapter.demo_prompt)
        try:
            if demo.sequential:
                for r in requests:
                    llm.generate([r.prompt], r.params, priority=[r.priority], use_tqdm=False)
            else:
                llm.generate([r.prompt for r in requests], [r.params for r in requests],
                             priority=[r.priority for r in requests], use_tqdm=False)
        finally:
            engine.close()  # a split engine's workers and process group end here (one process: nothing to do)
        view.close()
        if "attention" in demo.kinds and layer0:
            console.print(Indent(render_layer_detail(layer0[0])))
            console.print()
        if "roofline" in demo.kinds and layer0:
            view.show(roofline_commentary(layer0[0]))
        if "speculative_cost" in demo.kinds:
            view.show(self._speculative_cost(demo, chapter.demo_prompt))

    def _communication(self, demo: Any, chapter: Chapter, console: Console) -> bool:
        """The tensor-parallel chapter's measurements: one all-reduce's latency across
        ``demo.allreduce_ranks`` processes, a token's all-reduces at that latency, and a one-process
        decode step timed now for comparison. Returns whether this build's engine takes the demo's
        settings (False: one line says the split engine is not available, and the demo ends here)."""
        from nanovllm_core.educational import tp_measure

        info = self.load()
        hidden, layers = int(info["hidden_size"]), int(info["num_layers"])
        check = HostCheck()  # over both measurements: a busy host's figures are told as such (trial 34e)
        m = tp_measure.measure_allreduce(demo.allreduce_ranks, hidden=hidden, iters=200, warmup=20)
        timed = self.one_process_decode_steps(demo, chapter)
        console.print(Indent(Text(communication_words(m, tp_facts.allreduces_per_step(layers), timed,
                                                      chapter.demo_prompt, weights=weights_label(info),
                                                      busy=check.note()))))
        console.print()
        if not split_engine_available():
            console.print(Indent(Text(SPLIT_UNAVAILABLE[0].upper() + SPLIT_UNAVAILABLE[1:] + ".", style="yellow")))
            console.print()
            return False
        return True

    def one_process_decode_steps(self, demo: Any, chapter: Chapter) -> list[ev.StepTimed]:
        """The chapter's first request run now on one process (a fresh engine over the loaded model):
        the ``StepTimed`` of each step that decoded, for :func:`communication_words`'s comparison
        (the CLI's and the app's chapter 13 alike)."""
        from nanovllm_core.llm import LLM

        (request,) = demo.requests(chapter.demo_prompt)[:1]
        timed: list[ev.StepTimed] = []
        one = self.engine()
        one.subscribe(lambda e: timed.append(e) if isinstance(e, ev.StepTimed) and e.num_decode_tokens else None,
                      topk=0, blocks=False, xray=False)
        LLM.from_engine(one).generate([request.prompt], request.params, use_tqdm=False)
        return timed

    def _speculative_cost(self, demo: Any, prompt: str) -> Commentary:
        """The verification's cost on this machine and Theorem 3.8's speed-up with it (two more runs, timed)."""
        settings = dict(demo.engine_settings())
        gamma = int(settings.pop("num_speculative_tokens", 4))
        proposer = settings.pop("speculative_model", "ngram")
        (request,) = demo.requests(prompt)[:1]
        check = HostCheck()  # a busy host's figures are told as such, as chapter 13's (trial 41e: v = 152 unflagged)
        m = speculative_costs.measure(lambda **kw: self.engine(**settings, **kw), prompt, request.params, gamma,
                                      proposer)
        text = (speculative_costs.cost_words(m) if m is not None else
                "The timed run verified no drafts, so there is no verification cost to report.")
        busy = check.note()
        if busy and m is not None:
            text += f" {busy[0].upper()}{busy[1:]}."
        return Commentary("speculative_cost", "What a verification costs here", text)
