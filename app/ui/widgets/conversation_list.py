"""The sidebar list of saved conversations, newest first."""

from __future__ import annotations

from textual.widgets import Label, ListItem, ListView

from duet.app.store import Conversation


class ConversationItem(ListItem):
    def __init__(self, conversation: Conversation):
        super().__init__(Label(conversation.title, markup=False))
        self.conversation = conversation


class ConversationList(ListView):
    """Selecting an item posts ListView.Selected with a ConversationItem."""

    async def show(self, conversations: list[Conversation], current: int | None) -> None:
        await self.clear()
        await self.extend(ConversationItem(c) for c in conversations)
        ids = [c.id for c in conversations]
        self.index = ids.index(current) if current in ids else None
