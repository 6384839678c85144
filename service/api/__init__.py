"""The HTTP layer's own modules, FastAPI and Starlette beside them; the domain code raises
``service.core.errors.APIError`` and never imports the framework."""
