"""Renderers: results in, strings out. Nothing here collects data or prints."""

from .text import format_bytes, format_duration, render_table

__all__ = ["format_bytes", "format_duration", "render_table"]
