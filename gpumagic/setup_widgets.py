"""Notebook view of a new public key: the key in a text box and a copy button.

Only display: the text comes from :func:`gpumagic.setup.public_key_text`, which is also the
``text/plain`` fallback shown where widgets do not render (terminal IPython, nbconvert,
GitHub's notebook viewer).  ipywidgets is imported only when a kernel front end can show it.
"""

from __future__ import annotations

import html

from .setup import KeyPair, public_key_text


def public_key_widget(pair: KeyPair):
    """An ipywidgets ``VBox``: heading, read-only-looking text box with the key, copy button.

    The copy button uses the browser's ``navigator.clipboard``; where a front end blocks it,
    the text box still lets the user select the line.  Returns None without ipywidgets.
    """
    try:
        import ipywidgets as w
    except ImportError:
        return None
    heading = w.HTML(f"<b>New SSH key</b> {html.escape(str(pair.path))} "
                     f"<code>{html.escape(pair.fingerprint)}</code><br>"
                     "Paste this public key into your GPU platform's SSH-key settings:")
    box = w.Textarea(value=pair.public_key, layout=w.Layout(width="100%", height="4.5em"))
    key_attr = html.escape(pair.public_key, quote=True)
    button = w.HTML(
        f'<button class="jupyter-button" data-key="{key_attr}" '
        "onclick=\"navigator.clipboard.writeText(this.dataset.key)"
        ".then(()=>{this.textContent='copied'})\">copy public key</button>")
    return w.VBox([heading, box, button])


def show_public_key(pair: KeyPair, shell=None) -> None:
    """Show the key: the widget plus its text fallback in a kernel, plain text otherwise."""
    text = public_key_text(pair)
    in_kernel = shell is not None and getattr(shell, "kernel", None) is not None
    view = public_key_widget(pair) if in_kernel else None
    if view is None:
        print(text)
        return
    from IPython.display import display

    display({"text/plain": text,
             "application/vnd.jupyter.widget-view+json": {
                 "version_major": 2, "version_minor": 0, "model_id": view.model_id}}, raw=True)
