"""The denoising engines behind one protocol (engine/base.py); build.py picks one."""

from storyboard_cli.engine.base import Engine, Shape

__all__ = ["Engine", "Shape"]
