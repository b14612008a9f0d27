"""Imported by the scorer pool's fork server (``set_forkserver_preload``): the fork server exits when the
driver that started it dies (:func:`trainer.orphans.watch_parent`). Deliberately light: no torch."""

from trainer.orphans import watch_parent

watch_parent()
