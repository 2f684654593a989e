"""The engine stage: the denoising loop (conditioning, sampling) and its engines behind one protocol (engine/base.py);
build.py picks one."""

from storyboard_cli.engine.base import Engine, Shape

__all__ = ["Engine", "Shape"]
