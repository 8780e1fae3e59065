"""Reports of a comparison: the Report (text, JSON), HTML, Markdown, and golden inspection."""
