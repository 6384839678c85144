"""The HTTP layer's own modules, FastAPI and Starlette beside them; the domain code raises
``service.core.errors.DomainError`` and never imports the framework (``errors`` maps it to HTTP)."""
