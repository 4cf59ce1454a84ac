"""The error a Hugging Face directory that kvjax cannot run raises."""


class UnsupportedModelError(ValueError):
    """The directory holds a model, or a setting of one, that kvjax does not implement."""
