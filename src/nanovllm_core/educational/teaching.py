"""Run a generation with the CLI's teaching views attached: ``--narrate``, ``--xray``, ``--dashboard``.

How the modes share one terminal without garbling each other: every view prints through
one Rich ``Console``, on the thread that runs the engine (``LLM.generate`` is synchronous,
so events arrive in order). The views subscribe in reading order, narrator first, then
X-Ray, then the dashboard, so at the end of a step the narrator's plain account comes
before X-Ray's detail of the same step. While the dashboard is live, Rich draws everything
else printed through the console above the live region; when the console is not a terminal,
the dashboard draws nothing until the end and then prints one snapshot after the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from nanovllm_core.educational.dashboard_view import DashboardView
from nanovllm_core.educational.narrate_view import NarrateView
from nanovllm_core.educational.xray_view import XRayView


@dataclass
class TeachingViews:
    """The views attached to one engine; :meth:`close` detaches them and draws final states."""

    engine: Any
    narrate: NarrateView | None = None
    xray: XRayView | None = None
    dashboard: DashboardView | None = None
    subscriptions: list = field(default_factory=list)

    @classmethod
    def attach(cls, engine: Any, console: Console, narrate: bool = False, xray: bool = False,
               dashboard: bool = False, narrate_steps: int | None = 10) -> "TeachingViews":
        """Subscribe the chosen views to ``engine`` (an ``LLMEngine``) and start the dashboard.

        ``narrate_steps``: decode entries per request (None: every token).
        """
        info = engine.model_info()
        views = cls(engine)
        if narrate:
            views.narrate = NarrateView(console, info, max_decode_steps=narrate_steps)
            views.subscriptions.append(views.narrate.subscribe(engine))
        if xray:
            views.xray = XRayView(console, engine)
            views.subscriptions.append(views.xray.subscribe())
        if dashboard:
            views.dashboard = DashboardView(console, info, xray=xray)
            views.subscriptions.append(views.dashboard.subscribe(engine))
            views.dashboard.start()
        return views

    @property
    def any(self) -> bool:
        return bool(self.narrate or self.xray or self.dashboard)

    def close(self) -> None:
        """Flush the narrator, stop the live dashboard (or print its snapshot), unsubscribe all."""
        try:
            if self.narrate is not None:
                self.narrate.close()
            if self.xray is not None:
                self.xray.close()
        finally:
            if self.dashboard is not None:
                self.dashboard.stop()
            for sub in self.subscriptions:
                self.engine.unsubscribe(sub)
            self.subscriptions.clear()
