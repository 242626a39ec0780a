"""Chat data and its rendering: dataset readers, one record to messages, chat-template renders and loss masks, render
workers, held-out prompts."""
