"""What a person runs: the CLI, headless mode, the chat UI. Imports engine; engine never imports this."""
