"""dsuf: DeepSeek Ultrafast, an inference engine and server for DeepSeek-V4.1-Flash and V4-Flash."""
