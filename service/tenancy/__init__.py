"""Who may do what: projects, their keys and the keys' scopes (``scopes``, ``keys``, ``projects``).
No HTTP here: the API's table of which route needs which scope is ``service.api.route_scopes``."""
